"""Per-run data stores from Debian's packages: Redis, memcached, PostgreSQL.

Each runs as `nobody` (not the system services: no init scripts, no system data directory),
on the deployment's own ports on 127.0.0.1, with its data under `<run dir>/stores/`, pinned
to `STORE_CPU` inside the testbed's cgroup tree. Durability is off (no RDB/AOF, fsync=off):
the stores hold benchmark data that `up` creates afresh.
"""

from __future__ import annotations

import glob
import shutil
import socket
import subprocess
import time
from pathlib import Path

from bmeg.faultinject.testbed.deployment import POSTGRES_DB, POSTGRES_USER, STORE_CPU, Ports
from bmeg.faultinject.testbed.system import ProcessRecord, TestbedError, spawn

STORE_USER = "nobody"
PACKAGES = "redis-server memcached postgresql"


def _which(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if not found:
        raise TestbedError(f"{name} is not installed: bash scripts/apt-install.sh {PACKAGES}")
    return found


def _owned_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    shutil.chown(path, STORE_USER)
    return path


def wait_port(port: int, timeout_s: float, what: str, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if not alive():
                break
            time.sleep(0.1)
    raise TestbedError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s:.0f} s")


def start_stores(run: Path, ports: Ports, cgroup) -> list[ProcessRecord]:
    """Start the three stores (cgroup: a function of the store's name giving its cgroup path)."""
    stores = run / "stores"
    stores.mkdir(parents=True, exist_ok=True)
    stores.chmod(0o755)
    logs = run / "logs"
    records = []

    redis_dir = _owned_dir(stores / "redis")
    records.append(spawn("redis", "store", [
        _which("redis-server"), "--port", str(ports.redis), "--bind", "127.0.0.1", "--dir", str(redis_dir),
        "--save", "", "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no", "--io-threads", "1"],
        logs / "redis.log", cpu=STORE_CPU, cgroup=cgroup("redis"), user=STORE_USER))

    records.append(spawn("memcached", "store", [
        _which("memcached"), "-l", "127.0.0.1", "-p", str(ports.memcached), "-U", "0", "-m", "64", "-t", "1"],
        logs / "memcached.log", cpu=STORE_CPU, cgroup=cgroup("memcached"), user=STORE_USER))

    pg_dir = stores / "postgres"
    if pg_dir.exists():
        shutil.rmtree(pg_dir)
    _owned_dir(pg_dir)
    initdb = subprocess.run(["setpriv", f"--reuid={STORE_USER}", "--regid=nogroup", "--clear-groups", "--",
                             _which("initdb"), "-D", str(pg_dir), "-U", POSTGRES_USER, "--auth=trust",
                             "-E", "UTF8", "--no-sync"], capture_output=True, text=True, cwd=pg_dir)
    if initdb.returncode != 0:
        raise TestbedError(f"initdb failed: {initdb.stderr.strip()[-500:]}")
    postgres = spawn("postgres", "store", [
        _which("postgres"), "-D", str(pg_dir), "-p", str(ports.postgres), "-k", str(pg_dir),
        "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off",
        "-c", "full_page_writes=off", "-c", "shared_buffers=32MB", "-c", "max_connections=200"],
        logs / "postgres.log", cpu=STORE_CPU, cgroup=cgroup("postgres"), user=STORE_USER, cwd=pg_dir)
    records.append(postgres)

    for record, port in zip(records, (ports.redis, ports.memcached, ports.postgres), strict=True):
        wait_port(port, 30, record.name, record.alive)
    _create_database(ports.postgres)
    return records


def _create_database(port: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        result = subprocess.run([_which("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", POSTGRES_USER,
                                 POSTGRES_DB], capture_output=True, text=True)
        if result.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise TestbedError(f"createdb {POSTGRES_DB} failed: {result.stderr.strip()}")
        time.sleep(0.3)  # PostgreSQL listens before it accepts connections
