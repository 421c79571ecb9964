"""The on-call page in headless Chromium: submit a trace, see the bottleneck highlighted; enter
the API key to see recent diagnoses; script in trace strings never runs (built as text, and the
Content-Security-Policy allows no inline script)."""

from __future__ import annotations

import io
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
import uvicorn
from playwright.sync_api import expect

from bmeg.serving.app import create_app
from bmeg.traces import to_otlp_proto_bytes, write_spans
from serving_fixtures import API_KEY, keyed_settings, running, traces_of

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def server_url(detector):
    app = create_app(detector, keyed_settings())
    with running(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")) as port:
        yield f"http://127.0.0.1:{port}"


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
    enter_key(page)
    yield page
    assert all(url.startswith(server_url) for url in requested), f"the page fetched from elsewhere: {requested}"
    page.close()


def enter_key(page) -> None:
    page.fill("#api-key", API_KEY)
    page.click("#save-key")
    # a locator, not wait_for_function: its string predicate is evaluated in the page, and the
    # page's own policy (no 'unsafe-eval') refused it once in a cold-cache CI run
    expect(page.locator("#model-info")).to_have_text(re.compile(r"^model: bmeg-"), timeout=30_000)


def test_without_the_key_the_page_asks_for_it(browser, server_url):
    page = browser.new_page()
    page.goto(server_url)
    page.wait_for_selector("#key-needed:not([hidden])")
    assert page.text_content("#model-info") == "model: enter the API key to see it"
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

    page.goto(server_url)  # a fresh page: the diagnosis is in the recent list (the key is kept in the tab)
    page.click("#recent li >> nth=0")
    page.wait_for_selector("#trace-picker button")
    assert page.locator("#trace-picker button").count() == 5
    page.screenshot(path=str(output_dir / "recent.png"), full_page=True)


def test_garbage_shows_the_servers_message(page):
    page.fill("#trace-text", "{\"resourceSpans\": [")
    page.click("#diagnose")
    page.wait_for_selector("#error:not([hidden])")
    assert page.text_content("#error").startswith("400: malformed trace payload")


SCRIPTS = ['<img src=x onerror="window.pwned=1">', "<script>window.pwned=1</script>",
           '<svg onload="window.pwned=1">', '"><script>window.pwned=1</script>', "javascript:window.pwned=1"]


def test_script_in_trace_strings_never_runs(page, flagged_trace, server_url):
    """Service, operation and trace strings full of markup: shown as text; and the page's policy
    forbids inline script even if one became markup (checked by injecting one)."""
    spans, _ = flagged_trace
    hostile = spans.set_column(spans.schema.get_field_index("operation"), "operation",
                               pa.array([SCRIPTS[i % len(SCRIPTS)] for i in range(spans.num_rows)]))
    hostile = hostile.set_column(hostile.schema.get_field_index("service"), "service",
                                 pa.array([f"{s}{SCRIPTS[i % len(SCRIPTS)]}" for i, s in enumerate(spans["service"].to_pylist())]))
    buffer = io.BytesIO()
    write_spans(hostile, buffer, "otlp-json")
    page.fill("#trace-text", buffer.getvalue().decode())
    page.click("#diagnose")
    page.wait_for_selector("#verdict strong")
    page.click("#recent li >> nth=0")
    page.wait_for_selector("#verdict strong")
    assert page.evaluate("window.pwned") is None
    assert any(SCRIPTS[1] in text for text in page.locator("#critical-path li").all_text_contents())
    # were a string ever to become markup, the policy would still stop it
    page.evaluate("""() => { const box = document.createElement('div');
        box.innerHTML = '<img src=x onerror="window.pwned=1">'; document.body.append(box);
        const s = document.createElement('script'); s.textContent = 'window.pwned=2'; document.body.append(s); }""")
    page.wait_for_timeout(300)
    assert page.evaluate("window.pwned") is None
    headers = page.request.get(server_url).headers
    assert "script-src 'self'" in headers["content-security-policy"] and headers["x-content-type-options"] == "nosniff"
