# Set-up and entry points. Every target creates or reuses .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# A range-satisfying torch is installed first so that pip does not pull a CUDA build.
TORCH_SPEC ?= torch==2.13.0
# Tests keep every cache and temporary file inside the working tree and never touch the network.
# The suite runs on TEST_WORKERS processes (pytest-xdist), one test file to a process.
TEST_WORKERS ?= 2
TEST_ARGS = -q -p randomly --randomly-seed=$${TEST_SEED:-1234} -n $(TEST_WORKERS) --dist loadfile
TEST_ENV := HF_HOME=$(CURDIR)/.cache/hf TMPDIR=$(CURDIR)/.cache/tmp HF_POWERNORM_CACHE=$(CURDIR)/.cache/kernels HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1

.PHONY: install train demo test test-oldest bench clean

# Exits 0 when the venv's torch satisfies TORCH_SPEC (a local build tag such as +cpu ignored); reads
# the installed version's metadata rather than importing torch, so every target pays milliseconds.
TORCH_CHECK = $(PY) -c "import sys; from importlib.metadata import version; \
	from packaging.requirements import Requirement; r = Requirement(sys.argv[1]); \
	sys.exit(r.name != 'torch' or not r.specifier.contains(version('torch').split('+')[0], prereleases=True))" \
	"$(TORCH_SPEC)" 2>/dev/null
TORCH_INSTALL = $(TORCH_CHECK) || $(PY) -m pip install -q "$(TORCH_SPEC)"

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(TORCH_INSTALL)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# An existing venv whose torch is not TORCH_SPEC's (make TORCH_SPEC=... test) gets it installed.
install: $(VENV)/.installed
	@$(TORCH_INSTALL)

# The main job: train a PowerNorm Transformer on the embedded translation corpus, evaluate, export.
train: install
	$(VENV)/bin/accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no \
		--dynamo_backend no recipes/train_wmt.py $(ARGS)

demo: install
	mkdir -p .cache/hf .cache/tmp
	$(TEST_ENV) $(PY) -m hf_powernorm.demo

test: install
	mkdir -p .cache/hf .cache/tmp
	$(TEST_ENV) $(PY) -m pytest $(TEST_ARGS) tests

# The same suite on the oldest versions setup.cfg allows (constraints-oldest.txt), in its own venv.
OLDEST_VENV := .venv-oldest
$(OLDEST_VENV)/.installed: setup.cfg pyproject.toml constraints-oldest.txt
	test -x $(OLDEST_VENV)/bin/python || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(OLDEST_VENV)/bin/python -m pip install -q -c constraints-oldest.txt torch
	$(OLDEST_VENV)/bin/python -m pip install -q -c constraints-oldest.txt -e ".[dev]"
	touch $@

test-oldest: $(OLDEST_VENV)/.installed
	mkdir -p .cache/hf .cache/tmp
	$(OLDEST_VENV)/bin/python -m pip list 2>/dev/null | grep -iE '^(torch|transformers|accelerate|datasets|peft) '
	$(TEST_ENV) $(OLDEST_VENV)/bin/python -m pytest $(TEST_ARGS) tests

bench: install
	$(PY) -m hf_powernorm.benchmarks

clean:
	rm -rf .cache .pytest_cache build *.egg-info $(OLDEST_VENV)
