# moestream: `make demo` runs a synthetic model under a tight RAM budget; `make test` runs the test suite.
#
# `make venv` creates .venv and installs torch first, then moestream (editable) with its test and server extras.
# The default TORCH_SPEC matches the CPU wheel available on the project's own machines; elsewhere choose your
# own build, e.g. `make venv TORCH_SPEC='torch>=2.2'` or a CUDA wheel index via PIP_EXTRA_INDEX_URL.
# Reinstalling happens only when pyproject.toml changes (the stamp file records the last install).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.moestream-installed

.PHONY: venv demo test clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -e '.[test,server,http]'
	touch $(STAMP)

demo: venv
	$(BIN)/moestream demo

test: venv
	$(BIN)/python -m pytest

clean-venv:
	rm -rf $(VENV)
