"""Datasets of labelled traces: generated with the fault-injection simulator, loaded by name or path."""

from bmeg.datasets.generate import Shard, generate_dataset
from bmeg.datasets.loader import Dataset, Split, load_dataset, read_dataset

__all__ = ["Dataset", "Shard", "Split", "generate_dataset", "load_dataset", "read_dataset"]
