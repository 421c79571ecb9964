"""AC@1 / Avg@5 of every ranker of a `bmeg evaluate rca --json` run, on a testbed campaign's code
faults split by what they did and the share of requests they hit (session 16).

    python bench/code_share.py --harness RCA.json --parameters D/faults.json [--json OUT]

The fault list names every code fault `exception`; `faults.json` says whether it failed
(`exception`) or returned early (`return`) and on what share of its operation's requests
(`bmeg.evaluation.faults.code_fault_kinds`). Prints one row per ranker: per kind, then per
share (both modes), then all code faults and the latency faults.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from bmeg.evaluation.faults import LATENCY_FAULTS, code_fault_kinds, fault_key


def by_share(harness: dict, kinds: dict[tuple[int, str], str]) -> pd.DataFrame:
    """One row per (fault, ranker): its group (`return share=0.05`, ...) and rank (None: unranked)."""
    rows = []
    for fault in harness["faults"]:
        kind = kinds.get(fault_key(fault["start_ns"], fault["service"]))
        if kind is None:
            kind = "latency" if fault["type"] in LATENCY_FAULTS else fault["type"]
        for ranker, rank in fault["rank"].items():
            rows.append({"ranker": ranker, "kind": kind, "share": kind.split("share=")[-1] if "share=" in kind else None,
                         "rank": rank})
    frame = pd.DataFrame(rows)
    frame["ac1"] = frame["rank"] == 1
    frame["avg5"] = frame["rank"].apply(lambda r: sum(r is not None and r == r and r <= k for k in range(1, 6)) / 5)
    return frame


def summary(frame: pd.DataFrame) -> dict:
    code = frame[frame["share"].notna()]
    groups = {**{k: g for k, g in code.groupby("kind")}, **{f"share={s}": g for s, g in code.groupby("share")},
              "code faults": code, "latency": frame[frame["kind"] == "latency"]}
    return {name: {ranker: {"n": int(len(r)), "ac1": round(float(r["ac1"].mean()), 2), "avg5": round(float(r["avg5"].mean()), 2)}
                   for ranker, r in group.groupby("ranker")} for name, group in groups.items() if len(group)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--harness", type=Path, required=True, help="bmeg evaluate rca --json output")
    parser.add_argument("--parameters", type=Path, required=True, help="the campaign's faults.json")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = summary(by_share(json.loads(args.harness.read_text()), code_fault_kinds(args.parameters)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    rankers = sorted({r for g in result.values() for r in g})
    print("group | n | " + " | ".join(rankers))
    for name, group in result.items():
        n = next(iter(group.values()))["n"]
        print(f"{name} | {n} | " + " | ".join(f"{group[r]['ac1']:.2f}/{group[r]['avg5']:.2f}" if r in group else "-"
                                              for r in rankers))


if __name__ == "__main__":
    main()
