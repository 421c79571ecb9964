#!/usr/bin/env bash
# Everything CI runs: start the real parts the integration tests need, then all of pytest.
set -euo pipefail
venv=${1:-.venv}
export PATH="$PWD/$venv/bin:$PATH"

status=0
python -m pytest -m "integration or not integration" -p no:cacheprovider || status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure" >&2
    exit 1
fi
exit "$status"
