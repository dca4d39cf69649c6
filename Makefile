# lineax_attn: the two commands a fresh machine needs.
#   make run   - create .venv if missing, install, run the main job (the tiny mixer comparison on CPU)
#   make test  - same set-up, then the test suite
# The venv is rebuilt only when setup.cfg or constraints.txt change (stamp file).

SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?= -n 2 --durations=25

.PHONY: run test test-all venv clean

# Find a Python >= 3.12: python3.12, python3.13, pyenv's builds (3.12 first: the GPU machine runs 3.12), then python3.
# Candidates are *run*, not trusted: pyenv's bare shims exit 127 when no version is selected.
define find_python
for c in python3.12 python3.13 \
         $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -V) \
         $$(command -v pyenv >/dev/null 2>&1 && ls -d $$(pyenv root)/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -V) \
         python3; do \
  if "$$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; then \
    echo "$$c"; exit 0; fi; \
done; exit 1
endef

$(STAMP): setup.cfg pyproject.toml constraints.txt
	@if [ ! -x $(PY) ] || ! $(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then \
	  rm -rf $(VENV); \
	  py=$$( $(find_python) ) || { echo "error: lineax_attn needs Python >= 3.12 (jax >= 0.11 requires it)." \
	    "Tried python3.13, python3.12, pyenv versions and python3. Install one, e.g. 'pyenv install 3.12' or 'apt-get install python3.12-venv'." >&2; exit 1; }; \
	  echo "Creating $(VENV) with $$py ($$($$py --version))"; \
	  $$py -m venv $(VENV) || exit 1; \
	fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,train]'
	@touch $(STAMP)

venv: $(STAMP)

# Single-threaded XLA CPU: tiny models gain nothing from a thread pool, and on a busy 2-core
# machine its threads stall each other (measured: 3x slower steps, 2x slower compiles).
# (XLA has no intra_op_parallelism_threads flag: with dashes it aborts on an unknown flag, without
# them XLA ignored it, as this target did until 2026-12-01.)
run: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} \
	XLA_FLAGS="$${XLA_FLAGS:---xla_cpu_multi_thread_eigen=false}" \
	$(PY) -m experiments.compare --config=configs/mixers.py:tiny --workdir=runs/default

test: $(STAMP)
	@JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests (exit 5); the suite must not be empty." >&2; exit 1; fi; \
	exit $$rc

# Every test, the `slow` ones too (setup.cfg's addopts deselect them by default).
test-all:
	@$(MAKE) --no-print-directory test PYTEST_ARGS="$(PYTEST_ARGS) -m 'slow or not slow'"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
