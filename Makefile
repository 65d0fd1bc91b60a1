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

.PHONY: venv demo test asan clean-venv

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

# AddressSanitizer: the native kernels rebuilt with -fsanitize=address into a private kernel cache (tools/
# asan_kernels.py), then their tests and the checkpoint fuzz run with libasan preloaded. Any out-of-bounds access
# aborts the run with ASan's report.
ASAN_CACHE ?= /tmp/moestream-asan
ASAN_TESTS ?= tests/test_native_kernels.py tests/test_fuzz_checkpoints.py tests/test_checkpoint_experts.py \
	tests/test_b12x.py tests/test_decode_block.py tests/test_rows_block.py tests/test_compute_dtype.py \
	tests/test_grouped_experts.py
asan: venv
	rm -rf $(ASAN_CACHE)
	XDG_CACHE_HOME=$(ASAN_CACHE) $(BIN)/python tools/asan_kernels.py
	XDG_CACHE_HOME=$(ASAN_CACHE) LD_PRELOAD=$$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 \
		$(BIN)/python -c "from moestream.kernels import cpu; assert cpu.available(), cpu.reason(); print('ASan kernels loaded')"
	XDG_CACHE_HOME=$(ASAN_CACHE) LD_PRELOAD=$$(gcc -print-file-name=libasan.so) \
		ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 $(BIN)/python -m pytest -p no:cacheprovider $(ASAN_TESTS)

clean-venv:
	rm -rf $(VENV)
