"""The closed loop on the real testbed, arms in alternation: no mitigation vs bmeg vs the HPA.

    nice -n 10 python bench/testbed_loop.py --scenario misconfiguration [--rounds 2] [--json OUT]

Starts its own testbed (own ports and run directory, `--port-base`), runs the scenario's fault
(`bmeg.mitigation.testbed.SCENARIOS`) through the arms `none`, `bmeg` and `hpa` in alternation,
`--rounds` times, each round rotated by one (none,bmeg,hpa / bmeg,hpa,none / ...) so that the
shared machine's load falls on every arm alike and no arm always runs first; then stops the
testbed (also on an error or a signal: `run_testbed_loop` undoes its fault and actions, `down`
the rest).

Prints, per arm and round, and per arm over the rounds (the median), in ms of end-to-end p95
from the root spans: p95 *before* (the arm's normal phase), *during* (the whole fault), *after*
(the fault's second half, where a mitigation had time to act), the median of the second half's
1-s p95s, and two ratios:
- `late_over_normal`: that median over the same median in the arm's own normal phase (1 = the
  fault's effect gone; the arms run a minute apart and the machine's load moves between them);
- `recovery_ratio`: the arm's late median over the `none` arm's of the same round (below 1:
  the mitigation took that share of the fault's late latency away; the `none` arm's is 1);
and the actions taken (applied, kept by verification, rolled back).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bmeg.faultinject.testbed.supervisor import Testbed, down, up
from bmeg.mitigation import load_catalogue, load_policy
from bmeg.mitigation.safety import DEFAULT_POLICY
from bmeg.mitigation.testbed import ARMS, SCENARIOS, ArmReport, TestbedLoopSettings, run_testbed_loop


def rotated(rounds: int) -> tuple[str, ...]:
    """none,bmeg,hpa then bmeg,hpa,none then hpa,none,bmeg ..."""
    return tuple(ARMS[(r + i) % len(ARMS)] for r in range(rounds) for i in range(len(ARMS)))


def actions(arm: ArmReport) -> dict:
    """Counts of what the arm did: actions applied (verifications and refusals aside), kept
    by verification, rolled back; and the applied ones, in words."""
    applied = [a for a in arm.actions if a["status"] == "applied"]
    return {"applied": len(applied),
            "kept": sum(1 for a in arm.actions if a["status"] == "kept"),
            "rolled_back": sum(1 for a in arm.actions if a["status"] == "rolled back"),
            "what": [f"{a['time_s']:g}s {a['service']} {a['action']} ({a.get('detail', '')})"
                     + (f" rolled back at {a['rolled_back_s']:g}s" if "rolled_back_s" in a else "") for a in applied]}


def rows(arms: list[ArmReport]) -> list[dict]:
    """One row per arm run, in the order run; rounds are counted by the `none` arms."""
    found = []
    by_round: dict[int, dict[str, ArmReport]] = {}
    for index, arm in enumerate(arms):
        round_of = index // len(ARMS)
        by_round.setdefault(round_of, {})[arm.arm] = arm
    for index, arm in enumerate(arms):
        round_of = index // len(ARMS)
        none_late = by_round[round_of]["none"].p95_late_median_ms if "none" in by_round[round_of] else float("nan")
        found.append({"round": round_of, "arm": arm.arm, "p95_before_ms": arm.p95_normal_ms,
                      "p95_during_ms": arm.p95_fault_ms, "p95_after_ms": arm.p95_late_ms,
                      "p95_after_median_1s_ms": arm.p95_late_median_ms, "late_over_normal": arm.late_over_normal,
                      "recovery_ratio": round(arm.p95_late_median_ms / none_late, 3),
                      "slo_violation_s": arm.slo_violation_s, "recovery_s": arm.recovery_s,
                      "errors": arm.error_share, "traces": arm.traces, **actions(arm)})
    return found


def summary(per_run: list[dict]) -> list[dict]:
    """Per arm, the median over its rounds of each figure; actions summed."""
    keys = ("p95_before_ms", "p95_during_ms", "p95_after_ms", "p95_after_median_1s_ms", "late_over_normal",
            "recovery_ratio", "slo_violation_s")
    found = []
    for arm in ARMS:
        runs = [r for r in per_run if r["arm"] == arm]
        if runs:
            found.append({"arm": arm, "rounds": len(runs),
                          **{k: round(statistics.median(r[k] for r in runs), 3) for k in keys},
                          "recovered_rounds": sum(1 for r in runs if r["recovery_s"] is not None),
                          **{k: sum(r[k] for r in runs) for k in ("applied", "kept", "rolled_back")}})
    return found


def table(records: list[dict], keys: tuple[str, ...]) -> str:
    lines = [" | ".join(keys), " | ".join("---" for _ in keys)]
    lines += [" | ".join(str(r[k]) for k in keys) for r in records]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--normal-s", type=float, default=15.0)
    parser.add_argument("--fault-s", type=float, default=45.0)
    parser.add_argument("--port-base", type=int, default=27000, help="the testbed's ports (its own, not `bmeg testbed up`'s)")
    parser.add_argument("--json", type=Path, help="write the figures (and every arm's report) here")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    settings = TestbedLoopSettings(normal_s=args.normal_s, fault_s=args.fault_s, arms=rotated(args.rounds))
    run = Path(tempfile.mkdtemp(prefix="bmeg-bench-loop-"))
    run.chmod(0o755)  # the stores run as nobody
    testbed = Testbed(args.port_base, run)
    began = time.time()
    try:
        up(testbed, rate=args.rate)
        report = run_testbed_loop(testbed, args.scenario, load_catalogue(), load_policy(DEFAULT_POLICY), settings,
                                  progress=lambda line: print(line, flush=True))
    finally:
        down(testbed)
    shutil.rmtree(run)  # the logs of a failed run stay, for reading
    per_run = rows(report.arms)
    overall = summary(per_run)
    print(f"\n{args.scenario}: {report.fault['source']} on {report.fault['service']} {report.fault['parameters']}, "
          f"{report.rate:g} req/s, SLO p95 {report.slo_ms:g} ms, {args.rounds} rounds, {time.time() - began:.0f} s with up/down")
    print(table(per_run, ("round", "arm", "p95_before_ms", "p95_during_ms", "p95_after_ms", "p95_after_median_1s_ms",
                          "late_over_normal", "recovery_ratio", "slo_violation_s", "recovery_s", "applied", "kept",
                          "rolled_back")))
    for r in per_run:
        for line in r["what"]:
            print(f"  round {r['round']} {r['arm']}: {line}")
    print("\nmedian over rounds")
    print(table(overall, ("arm", "rounds", "p95_before_ms", "p95_during_ms", "p95_after_ms", "p95_after_median_1s_ms",
                          "late_over_normal", "recovery_ratio", "slo_violation_s", "recovered_rounds", "applied", "kept",
                          "rolled_back")))
    if args.json:
        args.json.write_text(json.dumps({"scenario": args.scenario, "rounds": args.rounds, "runs": per_run,
                                         "summary": overall, "report": asdict(report)}, indent=1, default=str))


if __name__ == "__main__":
    main()
