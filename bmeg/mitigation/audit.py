"""The controller's audit log: every decision, action, verification and rollback, in SQLite.

Append-only: triggers refuse UPDATE and DELETE, so a record once written stays as written.
Each record has a time, a kind, the service, the action, an outcome, whether it was a dry
run, and the details as JSON. `bmeg mitigate log` reads it.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from bmeg.paths import cache_dir

Kind = Literal["decision", "action", "verification", "rollback", "refused", "error"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    service TEXT NOT NULL,
    action TEXT NOT NULL,
    outcome TEXT NOT NULL,
    dry_run INTEGER NOT NULL,
    details TEXT NOT NULL
);
CREATE TRIGGER IF NOT EXISTS audit_no_update BEFORE UPDATE ON audit
BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
CREATE TRIGGER IF NOT EXISTS audit_no_delete BEFORE DELETE ON audit
BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
"""


def default_audit_path() -> Path:
    return cache_dir() / "mitigation-audit.sqlite"


@dataclass(frozen=True)
class Record:
    id: int
    time: float
    kind: str
    service: str
    action: str
    outcome: str
    dry_run: bool
    details: dict[str, Any]


class AuditLog:
    def __init__(self, path: str | Path = ":memory:"):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path)
        self._db.executescript(_SCHEMA)

    def append(self, kind: Kind, service: str, action: str, outcome: str, *, dry_run: bool,
               details: dict[str, Any] | None = None, at: float | None = None) -> int:
        cursor = self._db.execute(
            "INSERT INTO audit (time, kind, service, action, outcome, dry_run, details) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (time.time() if at is None else at, kind, service, action, outcome, int(dry_run),
             json.dumps(details or {}, default=str, sort_keys=True)),
        )
        self._db.commit()
        assert cursor.lastrowid is not None  # an INSERT always sets it
        return cursor.lastrowid

    def records(self, *, service: str | None = None, kind: str | None = None, limit: int | None = None) -> list[Record]:
        """Records oldest first (the newest `limit` of them when given)."""
        where, arguments = [], []
        if service:
            where.append("service = ?")
            arguments.append(service)
        if kind:
            where.append("kind = ?")
            arguments.append(kind)
        sql = "SELECT id, time, kind, service, action, outcome, dry_run, details FROM audit"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id DESC"
        if limit:
            sql += f" LIMIT {int(limit)}"
        rows = self._db.execute(sql, arguments).fetchall()
        return [Record(r[0], r[1], r[2], r[3], r[4], r[5], bool(r[6]), json.loads(r[7])) for r in reversed(rows)]

    def close(self) -> None:
        self._db.close()
