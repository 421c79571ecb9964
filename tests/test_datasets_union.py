"""A folder of dataset folders loads as their union, unless their trace ids clash."""

import pytest

from bmeg.datasets import generate_dataset
from bmeg.datasets.loader import read_dataset

pytestmark = pytest.mark.integration  # generation takes ~10 s a dataset


def test_union_of_scenarios_with_distinct_seeds(tmp_path):
    generate_dataset(tmp_path / "single", "hotelreservation", traces=200, imbalance=0.3, seed=1, progress=False)
    generate_dataset(tmp_path / "multiple", "hotelreservation", traces=200, imbalance=0.3, seed=2,
                     scenario="multiple", progress=False)
    union = read_dataset(tmp_path)
    assert union.traces.num_rows == 400 and len(union.cards) == 2


def test_folders_sharing_trace_ids_are_refused(tmp_path):
    for name in ("a", "b"):
        generate_dataset(tmp_path / name, "hotelreservation", traces=200, imbalance=0.3, seed=7, progress=False)
    with pytest.raises(ValueError, match="share .* trace ids.*different --seed"):
        read_dataset(tmp_path)
