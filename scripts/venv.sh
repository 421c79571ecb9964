#!/usr/bin/env bash
# Create the virtual environment and install bmeg with its dev extras, at the versions pinned by
# requirements.lock (pip constraints: what CI, the wheel check and the container install).
# pip keeps its download cache under ~/.cache/pip, so a second machine set-up is quick.
set -euo pipefail
venv=${1:-.venv}
python=${2:-python3}
# torch from PyPI brings its CUDA libraries: the venv takes ~7 GB. Say so before pip fails on a full disk.
free_gb=$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')
if [ "$free_gb" -lt 10 ]; then
    echo "venv.sh: only ${free_gb} GB free on $(df -P . | awk 'NR==2 {print $6}'); the venv needs ~7 GB and the tests ~10 GB more" >&2
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -c requirements.lock -e '.[dev]'
touch "$venv/.installed"
