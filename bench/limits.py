"""The server at its limits: peak memory, and small requests while a large one runs.

    python bench/limits.py --model RUN_DIR [--concurrent 4]

Starts `bmeg serve --no-auth` (the settings' defaults, or the `BMEG_*` environment) and
samples the resident memory of the server and its children every 20 ms while it is sent:

1. the largest request the limits let through: `BMEG_MAX_TRACES` traces of 10 spans
   (`BMEG_MAX_SPANS` spans), OTLP protobuf; then the same as OTLP/JSON, gzip-compressed;
2. `--concurrent` of those at once;
3. a gzip bomb (64 KB inflating to 1 GB) with `Content-Encoding: gzip`, and one without it;
4. more of the largest, until the recent diagnoses hold their byte limit (`BMEG_RECENT_BYTES`).

It prints each step's status, answer size, seconds and the peak RSS so far. Then, for the
starvation claim, a server started with splitting off (`BMEG_SPLIT_SPANS` above any request)
and one with the default: one of the largest requests, and meanwhile one-trace requests every
100 ms; it prints the small requests' p50 and max latency and the large one's time, both ways.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pyarrow as pa

from bmeg.serving.settings import ServingSettings
from bmeg.traces import to_otlp_proto_bytes
from bmeg.traces.otlp import table_to_otlp_json
from ingest import random_traces  # bench/ingest.py, beside this file
from serve import free_port, wait_ready  # bench/serve.py

PROTOBUF = {"content-type": "application/x-protobuf"}


class PeakRss:
    """The peak resident memory of a process and its children, sampled on a thread."""

    def __init__(self, pid: int, every_s: float = 0.02):
        self.process, self.every_s, self.peak = psutil.Process(pid), every_s, 0
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rss = sum(p.memory_info().rss for p in [self.process, *self.process.children(recursive=True)])
            except psutil.NoSuchProcess:
                return
            self.peak = max(self.peak, rss)
            time.sleep(self.every_s)

    def stop(self) -> None:
        self._stop.set()


def start_server(model: Path, port: int, env: dict[str, str]) -> subprocess.Popen:
    command = [str(Path(sys.executable).parent / "bmeg"), "serve", "--model", str(model), "--port", str(port),
               "--no-auth", "--device", "cpu", "--log-level", "warning"]
    server = subprocess.Popen(command, env={**os.environ, **env})
    try:
        wait_ready(f"http://127.0.0.1:{port}")
    except BaseException:  # never leave a server behind
        server.terminate()
        server.wait(30)
        raise
    return server


def traces(count: int, spans_per_trace: int, seed: int) -> pa.Table:
    return random_traces(count, spans_per_trace, seed=seed)


def step(client: httpx.Client, rss: PeakRss, name: str, body: bytes, headers: dict) -> None:
    started = time.perf_counter()
    response = client.post("/diagnose", content=body, headers=headers)
    print(f"{name:<48} body {len(body) / 2**20:6.1f} MiB  -> {response.status_code} "
          f"{len(response.content) / 2**20:6.1f} MiB in {time.perf_counter() - started:5.1f} s   "
          f"peak RSS {rss.peak / 2**20:6.0f} MiB", flush=True)


def memory(args, settings: ServingSettings) -> None:
    port = free_port()
    server = start_server(args.model, port, {})
    rss = PeakRss(server.pid)
    try:
        time.sleep(0.5)
        print(f"idle, model loaded: RSS {rss.peak / 2**20:.0f} MiB")
        largest = traces(settings.max_traces, settings.max_spans // settings.max_traces, seed=1)
        proto = to_otlp_proto_bytes(largest)
        as_json = gzip.compress(json.dumps(table_to_otlp_json(largest)).encode(), 1)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            step(client, rss, f"{settings.max_traces} traces x {largest.num_rows // settings.max_traces} spans, protobuf",
                 proto, PROTOBUF)
            step(client, rss, "the same as OTLP/JSON, gzip", as_json,
                 {"content-type": "application/json", "content-encoding": "gzip"})
            bomb = gzip.compress(b" " * 2**30, 9)
            step(client, rss, "gzip bomb (1 GiB inflated), Content-Encoding: gzip", bomb, {**PROTOBUF, "content-encoding": "gzip"})
            step(client, rss, "gzip bomb without Content-Encoding", bomb, PROTOBUF)
            bodies = [to_otlp_proto_bytes(traces(settings.max_traces, settings.max_spans // settings.max_traces, seed=10 + i))
                      for i in range(args.concurrent)]
        started = time.perf_counter()

        async def concurrently() -> list[int]:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
                answers = await asyncio.gather(*(client.post("/diagnose", content=b, headers=PROTOBUF) for b in bodies))
            return [a.status_code for a in answers]

        statuses = asyncio.run(concurrently())
        print(f"{args.concurrent} of the largest at once{'':<24} -> {statuses} in {time.perf_counter() - started:5.1f} s   "
              f"peak RSS {rss.peak / 2**20:6.0f} MiB", flush=True)
        answer_bytes = 5.4 * 2**20  # about, per largest request (printed above)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            for i in range(int(settings.recent_bytes / answer_bytes) + 1 - 2 - args.concurrent):
                body = to_otlp_proto_bytes(traces(settings.max_traces, settings.max_spans // settings.max_traces, seed=50 + i))
                client.post("/diagnose", content=body, headers=PROTOBUF)
        print(f"recent diagnoses filled to {settings.recent_bytes / 2**20:.0f} MiB{'':<22} peak RSS {rss.peak / 2**20:6.0f} MiB")
        print(f"peak RSS of the server at its limits: {rss.peak / 2**20:.0f} MiB")
    finally:
        rss.stop()
        server.terminate()
        server.wait(30)


def starvation(args, settings: ServingSettings, split: bool) -> tuple[list[float], float]:
    port = free_port()
    server = start_server(args.model, port, {} if split else {"BMEG_SPLIT_SPANS": str(10**9)})
    large = to_otlp_proto_bytes(traces(settings.max_traces, settings.max_spans // settings.max_traces, seed=2))
    small = [to_otlp_proto_bytes(traces(1, 10, seed=100 + i)) for i in range(200)]

    async def run() -> tuple[list[float], float]:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            for body in small[:5]:  # warm
                await client.post("/diagnose", content=body, headers=PROTOBUF)
            started = time.perf_counter()
            big = asyncio.create_task(client.post("/diagnose", content=large, headers=PROTOBUF))
            waits: list[float] = []

            async def one(body: bytes) -> None:
                sent = time.perf_counter()
                response = await client.post("/diagnose", content=body, headers=PROTOBUF)
                assert response.status_code == 200, response.text
                waits.append(time.perf_counter() - sent)

            pending = []
            for body in small[5:]:
                if big.done():
                    break
                pending.append(asyncio.create_task(one(body)))
                await asyncio.sleep(0.1)
            answer = await big
            large_s = time.perf_counter() - started
            await asyncio.gather(*pending)
            assert answer.status_code == 200, answer.text
            return waits, large_s

    try:
        return asyncio.run(run())
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="Run directory of `bmeg train`.")
    parser.add_argument("--concurrent", type=int, default=4, help="Largest requests sent at once.")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    settings = ServingSettings(no_auth=True)
    if not args.skip_memory:
        memory(args, settings)
    for split in (False, True):
        waits, large_s = starvation(args, settings, split)
        ms = np.array(waits) * 1e3
        print(f"split {'on ' if split else 'off'}: {len(ms)} small requests while a {settings.max_traces}-trace request ran "
              f"({large_s:.1f} s): p50 {np.median(ms):.0f} ms, max {ms.max():.0f} ms", flush=True)


if __name__ == "__main__":
    main()
