#!/usr/bin/env bash
# Debian's Chromium and its WebDriver, for the browser tests; installs them only when missing.
set -euo pipefail

if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then exit 0; fi
echo "chromium.sh: installing Debian's chromium and chromium-driver" >&2
bash "$(dirname "$0")/apt-install.sh" chromium chromium-driver
