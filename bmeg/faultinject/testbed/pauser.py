"""Stop-the-world pauses of one process on a schedule: SIGSTOP, wait `pause`, SIGCONT, wait.

Run as its own small process (stdlib only, so it starts in ~20 ms) by the background fault:
    python pauser.py PID TICKS PAUSE_MS EVERY_MS SEED UNTIL_UNIX_S
Pause lengths are uniform in [0.5, 1.5] x PAUSE_MS and the gaps between pauses exponential
with mean EVERY_MS (the simulator's `_pauses`). It never leaves the target stopped when it
exits: on SIGTERM, SIGINT or at UNTIL it sends SIGCONT first. After a SIGKILL of this process
the testbed's repair sends SIGCONT (the fault's undo record names the target). TICKS is the
target's start time (/proc/PID/stat field 22): a reused pid is never signalled.
"""

import os
import random
import signal
import sys
import time


def _ticks(pid: int):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2 :].split()[19])


def main(argv: list) -> int:
    pid, ticks = int(argv[1]), int(argv[2])
    pause_s, every_s = float(argv[3]) / 1e3, float(argv[4]) / 1e3
    rng = random.Random(int(argv[5]))
    until = float(argv[6])

    def resume(*_):
        if _ticks(pid) == ticks:
            os.kill(pid, signal.SIGCONT)
        sys.exit(0)

    signal.signal(signal.SIGTERM, resume)
    signal.signal(signal.SIGINT, resume)
    while True:
        gap = rng.expovariate(1 / every_s) if every_s > 0 else 0.0
        if time.time() + gap >= until:
            time.sleep(max(0.0, until - time.time()))
            break
        time.sleep(gap)
        if _ticks(pid) != ticks:
            return 0
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(min(pause_s * rng.uniform(0.5, 1.5), max(0.0, until - time.time())))
        finally:
            os.kill(pid, signal.SIGCONT)
    resume()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
