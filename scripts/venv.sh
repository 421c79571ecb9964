#!/usr/bin/env bash
# Create the virtual environment and install bmeg with its dev extras, at the versions pinned by
# requirements.lock (pip constraints: what CI, the wheel check and the container install).
# pip keeps its download cache under ~/.cache/pip, so a second machine set-up is quick.
set -euo pipefail
venv=${1:-.venv}
python=${2:-python3}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -c requirements.lock -e '.[dev]'
touch "$venv/.installed"
