"""The on-call page in headless Chromium: submit a trace, see the bottleneck highlighted."""

from __future__ import annotations

import io
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn

from bmeg.serving.app import create_app
from bmeg.traces import to_otlp_proto_bytes, write_spans
from serving_fixtures import traces_of

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def server_url(detector):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(detector), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists() or shutil.which("chromium") is None:
        pytest.skip("Chromium is not installed (scripts/chromium.sh installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, server_url):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    requested = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(server_url)
    yield page
    assert all(url.startswith(server_url) for url in requested), f"the page fetched from elsewhere: {requested}"
    page.close()


def test_a_pasted_trace_shows_its_bottleneck_and_critical_path(page, flagged_trace, output_dir):
    spans, flagged = flagged_trace
    buffer = io.BytesIO()
    write_spans(spans, buffer, "otlp-json")
    page.fill("#trace-text", buffer.getvalue().decode())
    page.click("#diagnose")

    page.wait_for_selector("#bottlenecks")
    assert page.text_content("#bottlenecks") == f"Bottleneck{'s' if len(flagged) > 1 else ''}: {', '.join(flagged)}"
    highlighted = page.eval_on_selector_all("g.node.bottleneck", "nodes => nodes.map(n => n.dataset.service)")
    assert set(highlighted) == set(flagged)
    assert page.locator(".edge.on-path").count() >= 1
    assert page.locator("#ranking tbody tr.bottleneck").count() == len(flagged)
    assert page.locator("#latencies tbody tr").count() >= 3
    assert "model: bmeg-" in page.text_content("#model-info")
    page.screenshot(path=str(output_dir / "diagnosis.png"), full_page=True)


def test_an_uploaded_protobuf_batch_then_a_recent_diagnosis_reopens(page, hotel_dataset, server_url, output_dir):
    batch = traces_of(hotel_dataset.spans, hotel_dataset.traces["trace_id"].to_pylist()[:5])
    page.set_input_files("#trace-file", files=[{"name": "batch.pb", "mimeType": "application/x-protobuf",
                                                "buffer": to_otlp_proto_bytes(batch)}])
    page.check("#window")
    page.click("#diagnose")
    page.wait_for_selector("#trace-picker button")
    assert page.locator("#trace-picker button").count() == 5
    assert page.locator("#window-ranking table tr").count() >= 3

    page.goto(server_url)  # a fresh page: the diagnosis is in the recent list
    page.click("#recent li >> nth=0")
    page.wait_for_selector("#trace-picker button")
    assert page.locator("#trace-picker button").count() == 5
    page.screenshot(path=str(output_dir / "recent.png"), full_page=True)


def test_garbage_shows_the_servers_message(page):
    page.fill("#trace-text", "{\"resourceSpans\": [")
    page.click("#diagnose")
    page.wait_for_selector("#error:not([hidden])")
    assert page.text_content("#error").startswith("400: malformed trace payload")
