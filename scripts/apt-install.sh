#!/usr/bin/env bash
# Install Debian packages (as root, or through sudo), refreshing the package lists first only
# when they were never fetched or are more than a week old.
#   scripts/apt-install.sh PACKAGE...
set -euo pipefail

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

lists_fresh() {
    [ -n "$(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages*' -mtime -7 -print -quit)" ]
}

# Wait for another apt run (a parallel install) instead of failing on its lock.
apt=(apt-get -q -o DPkg::Lock::Timeout=600)
if ! lists_fresh; then as_root "${apt[@]}" update; fi
as_root env DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y --no-install-recommends "$@"
