# The README's two commands: `make run` (the main job) and `make test` (everything CI runs).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: run test venv

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements.lock
	bash scripts/venv.sh $(VENV) $(PYTHON)

run: venv
	$(BIN)/bmeg demo

test: venv
	bash scripts/test.sh $(VENV)
