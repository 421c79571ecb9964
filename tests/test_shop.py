"""The shop (testbed/shop): a second real application, nine Python services traced by the
OpenTelemetry Python SDK. Fast checks of its fault plan and admin switch; end to end (integration,
root): a short recording through the real Collector with one fault of each kind, the faults seen in
the real spans where the recording says, labelled per trace, and nothing left running."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from bmeg.datasets.loader import read_dataset
from bmeg.evaluation.faults import read_fault_list
from bmeg.faultinject.testbed import system
from bmeg.faultinject.testbed.system import SOURCE_ROOT
from bmeg.traces.io import read_spans

sys.path.insert(0, str(SOURCE_ROOT / "testbed" / "shop"))
import record  # noqa: E402 (testbed/shop's scripts, beside the application)
import shop  # noqa: E402


def test_the_plan_puts_each_latency_fault_on_every_service_and_breaks_each_code_operation_once():
    faults = record.plan_faults(39)
    assert faults == record.plan_faults(39) and faults != record.plan_faults(40)  # the seed decides the order
    for service in shop.SERVICES:
        kinds = sorted(f.kind for f in faults if f.service == service and f.kind not in ("exception", "return"))
        # a delay into the entry: the load that would see it is not traced
        assert kinds == ["cpu_consumed", "cpu_contention"] + (["network_delay"] if service != shop.ENTRY else [])
    code = [f for f in faults if f.kind in ("exception", "return")]
    assert sorted(f.parameters["operation"] for f in code) == sorted(record.CODE_OPERATIONS)
    assert all(shop.SERVES[f.parameters["operation"]] == f.service for f in code)
    assert len(record.plan_faults(39, limit=3)) == 3


def test_every_operation_is_served_costs_cpu_and_is_implemented():
    assert set(shop.SERVES) == set(shop.OPERATIONS) == set(shop.WORK_US)
    assert set(shop.SERVES.values()) == set(shop.SERVICES)
    assert set(shop.MIX) <= {op for op, service in shop.SERVES.items() if service == "frontend"}


def test_a_fault_switch_names_an_operation_of_the_service_and_a_known_mode():
    service = shop.Service.__new__(shop.Service)  # the switch alone: no tracer, no store
    service.name, service.faults = "catalog", {}
    assert shop.set_fault(service, {"operation": "list_products", "mode": "error"}) == (200, {"list_products": "error"})
    assert shop.set_fault(service, {"operation": "get_cart", "mode": "error"})[0] == 400  # the cart's
    assert shop.set_fault(service, {"operation": "list_products", "mode": "slow"})[0] == 400
    assert shop.set_fault(service, {"mode": "error"})[0] == 400
    assert shop.set_fault(service, {"operation": "list_products", "mode": None}) == (200, {})


def test_a_service_answers_malformed_huge_and_non_object_bodies_with_a_clear_error_and_keeps_serving():
    import http.client
    import threading
    from http.server import ThreadingHTTPServer

    service = shop.Service("currency", {}, None)
    server = ThreadingHTTPServer(("127.0.0.1", 0), shop.handler_for(service))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        def post(body: bytes, headers: dict | None = None) -> tuple[int, dict]:
            connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=5)
            connection.request("POST", "/convert", body, headers or {})
            response = connection.getresponse()
            answer = (response.status, json.loads(response.read()))
            connection.close()
            return answer

        assert post(b"{not json")[0] == 400
        assert post(b"[1, 2]")[0] == 400
        assert post(b"{}", {"content-length": str(shop.MAX_BODY_BYTES + 1)})[0] == 413
        assert post(b"{}", {"content-length": "lots"})[0] == 413
        assert post(json.dumps({"amounts": [10.0]}).encode()) == (200, {"amounts": [9.3]})  # its neighbours unharmed
    finally:
        server.shutdown()
        service.provider.shutdown()


def _server_spans(spans, service: str, start: int, end: int):
    keep = pc.and_(pc.and_(pc.equal(spans["service"], service), pc.equal(spans["kind"], "server")),
                   pc.and_(pc.greater_equal(spans["start_ns"], start), pc.less(spans["start_ns"], end)))
    return spans.filter(keep)


def _calls_per_s(spans, operation: str, start: int, end: int) -> float:
    return _server_spans(spans.filter(pc.equal(spans["operation"], operation)), "currency", start, end).num_rows / (end - start) * 1e9


@pytest.mark.parametrize("recording", [None, "not json", json.dumps({"phases": {}})])
def test_labelling_a_missing_or_malformed_recording_again_is_a_clear_error(tmp_path: Path, monkeypatch, capsys,
                                                                         recording):
    if recording is not None:
        (tmp_path / "recording.json").write_text(recording)
        pq.write_table(pa.table({"trace_id": ["a"]}), tmp_path / "spans.parquet")
    monkeypatch.setattr(sys, "argv", ["record.py", "--label-only", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as stopped:
        record.main()
    assert stopped.value.code == 2 and "recording" in capsys.readouterr().err
    assert not (tmp_path / "dataset").exists()


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.skipif(os.geteuid() != 0, reason="the shop's faults need root (cgroups)")
@pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("stress-ng") is None,
                    reason="bash scripts/apt-install.sh redis-server stress-ng")
def test_a_short_recording_shows_each_fault_in_the_real_spans_and_leaves_nothing_running(tmp_path: Path):
    faults = [record.Fault("catalog", "cpu_contention", {"factor": 10.0}),
              record.Fault("cart", "exception", {"operation": "get_cart"}),
              record.Fault("catalog", "return", {"operation": "list_products"}),
              record.Fault("currency", "network_delay", {"delay_ms": 30.0, "jitter_ms": 0.0})]
    summary = record.record(tmp_path, rate=20.0, seed=0, normal_s=10.0, healthy_s=3.0, fault_s=6.0, gap_s=4.0,
                            faults=faults, warmup_s=3.0, base=23400)

    spans = read_spans(tmp_path / "spans.parquet")
    assert set(shop.SERVICES) <= set(pc.unique(spans["service"]).to_pylist())
    stores = spans.filter(pc.and_(pc.equal(spans["kind"], "client"), pc.equal(spans["db_system"], "redis")))
    assert stores.num_rows > 0  # the cart's and catalog's Redis calls, as the database conventions name them
    assert summary["load_answers"] and summary["load_answers"].get("200", 0) > 0
    normal_start, normal_end = summary["phases"]["normal"]
    normal = read_spans(tmp_path / "normal.parquet")
    assert normal.num_rows > 0 and pc.min(normal["start_ns"]).as_py() >= normal_start

    listed = read_fault_list(tmp_path / "fault_list.json")
    assert [(f.service, f.kind) for f in listed] == [(f.service, f.kind) for f in faults]
    hog, exception, early, delay = summary["faults"]
    before = _server_spans(spans, "catalog", normal_start, normal_end)["duration_ns"].to_numpy()
    during = _server_spans(spans, "catalog", hog["start_ns"] + 1_000_000_000, hog["end_ns"])["duration_ns"].to_numpy()
    assert np.median(during) > 2 * np.median(before)  # the hog in its cgroup slowed the catalog
    failed = _server_spans(spans, "cart", exception["start_ns"], exception["end_ns"])
    assert pc.sum(pc.equal(failed["status"], "error")).as_py() > 0
    assert "error" not in _server_spans(spans, "cart", normal_start, normal_end)["status"].to_pylist()
    # an empty catalog: the front end converts no prices, so the currency service gets fewer calls
    during_early = _calls_per_s(spans, "convert", early["start_ns"] + 1_000_000_000, early["end_ns"])
    assert during_early < 0.5 * _calls_per_s(spans, "convert", normal_start, normal_end)

    # a delay on the currency's proxy: its callers' calls stretch by it, its own spans do not
    calls = spans.filter(pc.and_(pc.equal(spans["kind"], "client"), pc.equal(spans["peer_service"], "currency")))
    delayed = calls.filter(pc.and_(pc.greater_equal(calls["start_ns"], delay["start_ns"] + 1_000_000_000),
                                   pc.less(calls["start_ns"], delay["end_ns"])))["duration_ns"].to_numpy()
    assert np.median(delayed) > 25e6
    served = _server_spans(spans, "currency", delay["start_ns"] + 1_000_000_000, delay["end_ns"])["duration_ns"].to_numpy()
    assert np.median(served) < 10e6

    # the faults' phase labelled per trace by the socialnet testbed's rule, a dataset bmeg reads
    dataset = read_dataset(tmp_path / "dataset")
    assert pc.min(dataset.spans["start_ns"]).as_py() >= summary["phases"]["healthy-busy"][1]
    labelled = dataset.traces.to_pandas()
    anomalous = labelled[labelled["anomalous"]]
    assert {"interference", "code", "network"} <= set(anomalous["fault_source"])
    assert all(services in ([hog["service"]], [exception["service"]], [early["service"]], [delay["service"]])
               for services in anomalous["fault_services"].map(list))
    assert dataset.nodes["bottleneck"].to_numpy().any()

    assert not system.cgroup_path("bmeg-shop-23400").exists()
    assert json.loads((tmp_path / "recording.json").read_text())["spans"] == spans.num_rows
