"""Span tables fetched from the trace stores platform teams run: Jaeger and Grafana Tempo.

Jaeger (query service, port 16686):

- `fetch_jaeger_v3_trace` / `fetch_jaeger_v3_traces`: `api_v3`, the supported HTTP API
  (`GET /api/v3/traces/{trace_id}`; `GET /api/v3/traces?query.service_name=&
  query.start_time_min=&query.start_time_max=&query.search_depth=[&query.operation_name=]`,
  RFC 3339 times). It answers OTLP/JSON, each chunk wrapped as `{"result": {"resourceSpans":
  [...]}}`, possibly several chunks one after another.
- `fetch_jaeger_traces`: the v1 query API the Jaeger UI uses (`GET /api/traces?service=&start=
  &end=&limit=`, microseconds), answering `{"data": [trace, ...]}`; Jaeger v2 may not serve it.

Tempo (HTTP API, port 3200):

- `fetch_tempo_trace`: `GET /api/traces/{trace_id}`, answering `{"batches": [resource spans]}`
  (OTLP/JSON with base64 ids);
- `fetch_tempo_traces`: `GET /api/search?tags=service.name=<service>&start=&end=&limit=` (Unix
  seconds), answering `{"traces": [{"traceID", ...}]}`, then each trace by id.

A store that cannot be reached, times out, or answers an HTTP error raises `TraceFetchError`
naming the URL (a trace or a search that finds nothing, HTTP 404, is an empty table); a body
that is no trace raises `TraceInputError`. Bodies are read up to `MAX_BODY_BYTES`.
"""

from __future__ import annotations

import datetime as dt
import json
import urllib.error
import urllib.parse
import urllib.request

import pyarrow as pa

from bmeg.traces.errors import TraceInputError
from bmeg.traces.io import read_spans_bytes
from bmeg.traces.schema import empty_span_table

DEFAULT_TIMEOUT_S = 30.0
#: The largest body read from a store (a search of thousands of big traces fits).
MAX_BODY_BYTES = 512 * 2**20


class TraceFetchError(RuntimeError):
    """A trace store could not be reached or answered an HTTP error."""


def fetch_jaeger_traces(
    query_url: str, service: str, start_s: float, end_s: float, limit: int = 1000, timeout_s: float = DEFAULT_TIMEOUT_S
) -> pa.Table:
    """The traces through `service` in [start_s, end_s] (Unix seconds) from Jaeger's v1 query API."""
    query = {"service": service, "start": int(start_s * 1e6), "end": int(end_s * 1e6), "limit": limit}
    return _read(_get(f"{_base(query_url)}/api/traces", query, timeout_s))


def fetch_jaeger_v3_trace(query_url: str, trace_id: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> pa.Table:
    """One trace by id from Jaeger's api_v3 (empty when Jaeger does not have it)."""
    return _read(_get(f"{_base(query_url)}/api/v3/traces/{_trace_id(trace_id)}", {}, timeout_s))


def fetch_jaeger_v3_traces(
    query_url: str,
    service: str,
    start_s: float,
    end_s: float,
    limit: int = 1000,
    operation: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> pa.Table:
    """The traces through `service` started in [start_s, end_s] (Unix seconds), from api_v3."""
    query = {
        "query.service_name": service,
        "query.start_time_min": _rfc3339(start_s),
        "query.start_time_max": _rfc3339(end_s),
        "query.search_depth": limit,
    }
    if operation is not None:
        query["query.operation_name"] = operation
    return _read(_get(f"{_base(query_url)}/api/v3/traces", query, timeout_s))


def fetch_tempo_trace(tempo_url: str, trace_id: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> pa.Table:
    """One trace by id from Tempo (empty when Tempo does not have it)."""
    return _read(_get(f"{_base(tempo_url)}/api/traces/{_trace_id(trace_id)}", {}, timeout_s))


def fetch_tempo_traces(
    tempo_url: str, service: str, start_s: float, end_s: float, limit: int = 20, timeout_s: float = DEFAULT_TIMEOUT_S
) -> pa.Table:
    """The traces through `service` in [start_s, end_s] (Unix seconds): Tempo's search, then
    each trace it found (the search answers summaries, not spans)."""
    query = {"tags": f"service.name={_logfmt(service)}", "start": int(start_s), "end": int(end_s) + 1, "limit": limit}
    url = f"{_base(tempo_url)}/api/search"
    body = _get(url, query, timeout_s)
    try:
        found = json.loads(body or b"{}").get("traces") or []
        trace_ids = [str(trace["traceID"]) for trace in found]
    except (ValueError, AttributeError, TypeError, KeyError) as error:
        raise TraceInputError(f"Tempo's search answered no trace list: {error!r} (from {url})") from None
    tables = [fetch_tempo_trace(tempo_url, trace_id, timeout_s) for trace_id in trace_ids]
    return pa.concat_tables(tables) if tables else empty_span_table()


def _get(url: str, query: dict, timeout_s: float) -> bytes | None:
    """The body of a GET (None for 404), at most MAX_BODY_BYTES."""
    if query:
        url = f"{url}?{urllib.parse.urlencode(query)}"
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read(MAX_BODY_BYTES + 1)
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        detail = error.read(500).decode("utf-8", "replace")
        raise TraceFetchError(f"{url} answered HTTP {error.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as error:  # refused, unresolvable, timed out
        raise TraceFetchError(f"cannot fetch {url}: {getattr(error, 'reason', error)}") from None
    if len(body) > MAX_BODY_BYTES:
        raise TraceFetchError(f"{url} answered more than {MAX_BODY_BYTES:,} bytes; ask for fewer traces")
    return body


def _read(body: bytes | None) -> pa.Table:
    if not body or not body.strip():
        return empty_span_table()
    return read_spans_bytes(body, "application/json")


def _base(url: str) -> str:
    return url.rstrip("/")


def _trace_id(trace_id: str) -> str:
    if not trace_id or not all(c in "0123456789abcdefABCDEF" for c in trace_id):
        raise TraceInputError(f"trace id {trace_id!r} is not hex")
    return trace_id.lower()


def _rfc3339(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat().replace("+00:00", "Z")


def _logfmt(value: str) -> str:
    """A logfmt value (Tempo's `tags`), quoted when it holds spaces, quotes or `=`."""
    return json.dumps(value) if any(c in value for c in ' "=') else value
