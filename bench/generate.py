"""How fast `bmeg generate socialnet` runs here: traces/s and spans/s with 1 process and with
2 workers, and the projected time for the thesis's 790,000-trace datasets.

    .venv/bin/python bench/generate.py [--traces 60000] [--imbalance 0.1] [--scenario single]

Everything counts: calibration, simulation, labelling, sampling and Parquet writing. The
machine may be shared, so CPU seconds (this process and its workers) are printed beside the
wall clock; the projection for 2 cores assumes both are free.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time

import pyarrow.parquet as pq

from bmeg.datasets import generate_dataset

THESIS_TRACES = 790_000


def measure(traces: int, imbalance: float, scenario: str, workers: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        started, cpu_started = time.perf_counter(), _cpu_seconds()
        card = generate_dataset(out, "socialnet", traces, imbalance, 0, scenario, workers=workers, progress=False)
        seconds, cpu = time.perf_counter() - started, _cpu_seconds() - cpu_started
        spans = pq.ParquetFile(f"{out}/spans.parquet").metadata.num_rows
    return {
        "workers": workers,
        "traces": card["traces"],
        "spans": spans,
        "episodes": card["episodes"],
        "seconds": seconds,
        "cpu_seconds": cpu,
        "traces_per_s": card["traces"] / seconds,
        "spans_per_s": spans / seconds,
        "projected_790k_min": THESIS_TRACES / (card["traces"] / seconds) / 60,
        "projected_790k_2cores_min": THESIS_TRACES / (card["traces"] / cpu) / 2 / 60,
    }


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=int, default=60_000)
    parser.add_argument("--imbalance", type=float, default=0.1)
    parser.add_argument("--scenario", default="single")
    args = parser.parse_args()
    print(f"socialnet, {args.traces} traces, imbalance {args.imbalance}, scenario {args.scenario}")
    print(f"{'workers':>7} {'traces':>8} {'spans':>9} {'episodes':>8} {'wall s':>7} {'cpu s':>7} "
          f"{'traces/s':>9} {'spans/s':>9} {'790k wall min':>13} {'790k on 2 free cores min':>24}")
    for workers in (1, 2):
        r = measure(args.traces, args.imbalance, args.scenario, workers)
        print(f"{r['workers']:>7} {r['traces']:>8} {r['spans']:>9} {r['episodes']:>8} {r['seconds']:>7.1f} "
              f"{r['cpu_seconds']:>7.1f} {r['traces_per_s']:>9.0f} {r['spans_per_s']:>9.0f} "
              f"{r['projected_790k_min']:>13.1f} {r['projected_790k_2cores_min']:>24.1f}")


if __name__ == "__main__":
    main()
