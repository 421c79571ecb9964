#!/usr/bin/env bash
# Everything CI runs: start the real parts the integration tests need, then all of pytest.
set -euo pipefail
venv=${1:-.venv}
export PATH="$PWD/$venv/bin:$PATH"
export BMEG_PYTHON="$PWD/$venv/bin/python"

# Lint and type check first: seconds, and a failure there says more than a test would.
ruff check bmeg tests bench notebooks testbed/shop
mypy
mypy testbed/shop/shop.py testbed/shop/record.py  # the shop's scripts, outside the package

# The real Kafka broker and Kubernetes API server (DESIGN.md section 6), and Chromium for the
# browser tests. Parts already running are reused and left running; what starts here stops on
# exit. The exported settings are what tests/conftest_infra.py reads.
started=()
stop_started() {
    local service
    for service in "${started[@]}"; do bash "scripts/$service.sh" stop || true; done
}
trap stop_started EXIT
for service in kafka kube-apiserver; do
    eval "$(bash "scripts/$service.sh" env)"
    if ! bash "scripts/$service.sh" status >/dev/null; then
        started+=("$service")
        bash "scripts/$service.sh" start
    fi
done
bash scripts/chromium.sh
# The real OpenTelemetry Collector for tests/test_collector_*.py and the testbed (built once, cached).
BMEG_OTELCOL_BINARY=$(bash scripts/otelcol.sh build)
export BMEG_OTELCOL_BINARY
# The socialnet testbed (tests/test_testbed_*.py): Debian's stores and tools, the Go application
# (each cached: apt skips what is installed, the build what is built).
if [ "$(id -u)" -eq 0 ] || command -v sudo >/dev/null; then
    bash scripts/apt-install.sh redis-server memcached postgresql stress-ng iproute2 >/dev/null
fi
if [ -f testbed/build.sh ]; then bash testbed/build.sh --test >/dev/null; fi  # its Go tests, then the binary

status=0
python -m pytest -m "integration or not integration" -p no:cacheprovider || status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure" >&2
    exit 1
fi
exit "$status"
