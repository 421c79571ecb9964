"""AC@1 of each method on latency faults, split by whether a code fault shares the window.

    python bench/concurrent_faults.py --harness RCA.json --faults D/fault_list.json [--window-minutes 0.1]

RCA.json is the `--json` output of `bmeg evaluate rca` on that fault list and window. The
testbed's campaign injects 2-3 faults at once, and the harness scores each fault against the
one ranking of its window: where an exception and a network delay start together, a ranking
can put only one of the two services first. A rule blind to code faults (the self-time rule)
spends every first place on the latency fault; a ranker that puts a changed structure first
(bmeg) spends it on the exception. This prints, per method, AC@1 on the latency faults whose
window holds a code fault and on those whose window does not, and AC@1 on the code faults,
so the two can be told apart, and beside each the harness's AC@1 with the window's other faulty
services out of the ranking (`ac1_others_removed`, in harness output since session 16). Nothing
here is re-ranked: the figures are the harness's.

It also prints the ceiling of AC@1 on the latency faults that any one ranking per round can
reach (a round: the faults starting within one window of its first): one fault first per round
that holds a latency fault; and the same where the round's code fault, if any, is put first (as
bmeg's structure gates do), which leaves a latency fault first only in rounds without one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bmeg.evaluation.faults import LATENCY_FAULTS, read_fault_list

CODE_FAULTS = {"exception", "return"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--harness", type=Path, required=True, help="bmeg evaluate rca --json output")
    parser.add_argument("--faults", type=Path, required=True)
    parser.add_argument("--window-minutes", type=float, default=0.1)
    parser.add_argument("--pod-suffix-parts", type=int, default=2)
    args = parser.parse_args()

    window_ns = int(args.window_minutes * 60e9)
    injected = read_fault_list(args.faults, args.pod_suffix_parts)
    code_starts = [f.start_ns for f in injected if f.kind in CODE_FAULTS]
    groups: dict[str, list[dict]] = {"latency, no code fault in the window": [],
                                     "latency, a code fault in the window": [], "code faults": []}
    for fault in json.loads(args.harness.read_text())["faults"]:
        if fault["type"] in CODE_FAULTS:
            groups["code faults"].append(fault)
        elif fault["type"] in LATENCY_FAULTS:
            shared = any(abs(start - fault["start_ns"]) < window_ns for start in code_starts)
            groups["latency, a code fault in the window" if shared else "latency, no code fault in the window"].append(fault)
    methods = next(iter(groups["code faults"] or groups["latency, a code fault in the window"]), {"rank": {}})["rank"]
    for name, faults in groups.items():
        cells = ", ".join(f"{m} {_ac1(faults, m, 'rank')}{_others_removed(faults, m)}" for m in methods)
        print(f"{name} ({len(faults)}): {cells}")
    kinds = [{f.kind for f in group} for group in rounds(injected, window_ns)]
    latency = sum(f.kind in LATENCY_FAULTS for f in injected)
    with_latency = [k for k in kinds if k & LATENCY_FAULTS]
    print(f"ceiling of latency AC@1, one first per round ({len(kinds)} rounds): "
          f"{len(with_latency) / max(latency, 1):.3f}; with each round's code fault first: "
          f"{sum(not k & CODE_FAULTS for k in with_latency) / max(latency, 1):.3f}")


def rounds(faults: list, window_ns: int) -> list[list]:
    """The faults grouped by start: each group the faults starting within `window_ns` of its first."""
    groups: list[list] = []
    for fault in sorted(faults, key=lambda f: f.start_ns):
        if groups and fault.start_ns - groups[-1][0].start_ns < window_ns:
            groups[-1].append(fault)
        else:
            groups.append([fault])
    return groups


def _ac1(faults: list[dict], method: str, key: str) -> str:
    return f"{sum(f[key][method] == 1 for f in faults) / max(len(faults), 1):.2f}"


def _others_removed(faults: list[dict], method: str) -> str:
    if not faults or "rank_others_removed" not in faults[0]:
        return ""
    return f" ({_ac1(faults, method, 'rank_others_removed')} others removed)"


if __name__ == "__main__":
    main()
