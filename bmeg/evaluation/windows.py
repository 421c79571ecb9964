"""Windows of traces from a file or a folder of trace files, read lazily.

`TraceFiles` reads each file once to learn the time its traces span (only two numbers are
kept), then `window(start, end)` reads just the files that overlap the window and keeps the
traces whose root starts in it. Memory holds one window's files at a time, never the whole
folder; they are kept until a window needs other files, with each trace's start, so that
consecutive windows over the same files (a fault list over one long recording: 270 windows
over one 935k-span file of the testbed took 27 s each on the loaded machine, re-reading it)
read them once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from tqdm import tqdm

from bmeg.traces.errors import TraceInputError
from bmeg.traces.io import read_spans
from bmeg.traces.schema import empty_span_table, trace_starts, traces_begun_between


@dataclass(frozen=True)
class _FileSpan:
    path: Path
    first_ns: int  # earliest span start
    last_ns: int  # latest span end


class TraceFiles:
    """The trace files under a path (a file, or a folder searched recursively)."""

    def __init__(self, path: str | Path, input_format: str | None = None, progress: bool = False):
        path = Path(path)
        if not path.exists():
            raise TraceInputError(f"{path} does not exist")
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise TraceInputError(f"{path} holds no trace files")
        self.format = input_format
        self._held: tuple[tuple[Path, ...], pa.Table, pa.Table] | None = None  # files, spans, trace starts
        self.files = []
        for file in tqdm(files, desc="indexing trace files", unit="file", disable=not progress):
            table = self._read(file)
            if table.num_rows:
                end = pc.add(table["start_ns"], table["duration_ns"])
                self.files.append(_FileSpan(file, pc.min(table["start_ns"]).as_py(), pc.max(end).as_py()))

    def _read(self, file: Path) -> pa.Table:
        return read_spans(file, format=self.format)

    def coverage(self) -> tuple[int, int] | None:
        """(earliest span start, latest span end) over every file, None when all are empty."""
        if not self.files:
            return None
        return min(f.first_ns for f in self.files), max(f.last_ns for f in self.files)

    def overlaps(self, start_ns: int, end_ns: int) -> bool:
        """Whether some file's time span overlaps [start_ns, end_ns)."""
        return any(f.first_ns < end_ns and f.last_ns >= start_ns for f in self.files)

    def window(self, start_ns: int, end_ns: int) -> pa.Table:
        """Spans of the traces whose root (earliest span) starts in [start_ns, end_ns)."""
        paths = tuple(f.path for f in self.files if f.first_ns < end_ns and f.last_ns >= start_ns)
        if not paths:
            return empty_span_table()
        if self._held is None or self._held[0] != paths:
            table = pa.concat_tables([self._read(path) for path in paths])
            self._held = (paths, table, trace_starts(table))
        _, table, first = self._held
        return traces_begun_between(table, start_ns, end_ns, starts=first)
