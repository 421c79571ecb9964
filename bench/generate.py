"""How fast `bmeg generate socialnet` runs here: traces/s and spans/s with 1 process and with
2 workers, and the projected time for the thesis's 790,000-trace datasets.

    .venv/bin/python bench/generate.py [--traces 60000] [--imbalance 0.1] [--scenario single]

Everything counts: calibration, simulation, labelling, sampling and Parquet writing.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import pyarrow.parquet as pq

from bmeg.datasets import generate_dataset

THESIS_TRACES = 790_000


def measure(traces: int, imbalance: float, scenario: str, workers: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        card = generate_dataset(out, "socialnet", traces, imbalance, 0, scenario, workers=workers, progress=False)
        seconds = time.perf_counter() - started
        spans = pq.ParquetFile(f"{out}/spans.parquet").metadata.num_rows
    return {
        "workers": workers,
        "traces": card["traces"],
        "spans": spans,
        "episodes": card["episodes"],
        "seconds": seconds,
        "traces_per_s": card["traces"] / seconds,
        "spans_per_s": spans / seconds,
        "projected_790k_min": THESIS_TRACES / (card["traces"] / seconds) / 60,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=int, default=60_000)
    parser.add_argument("--imbalance", type=float, default=0.1)
    parser.add_argument("--scenario", default="single")
    args = parser.parse_args()
    print(f"socialnet, {args.traces} traces, imbalance {args.imbalance}, scenario {args.scenario}")
    print(f"{'workers':>7} {'traces':>8} {'spans':>9} {'episodes':>8} {'seconds':>8} {'traces/s':>9} {'spans/s':>9} {'790k (min)':>10}")
    for workers in (1, 2):
        r = measure(args.traces, args.imbalance, args.scenario, workers)
        print(f"{r['workers']:>7} {r['traces']:>8} {r['spans']:>9} {r['episodes']:>8} {r['seconds']:>8.1f} "
              f"{r['traces_per_s']:>9.0f} {r['spans_per_s']:>9.0f} {r['projected_790k_min']:>10.1f}")


if __name__ == "__main__":
    main()
