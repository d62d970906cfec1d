# Two commands set up a fresh machine:
#   make run   - install what is missing (torch included), build, run `python -m torchfuse`
#   make test  - install the test dependencies, build, run the test suite
PYTHON ?= python3
PIP = $(PYTHON) -m pip
TORCH_VERSION ?= 2.14.1
# tests/test_hf.py runs against the oldest and the newest transformers release torchfuse.patch_hf is
# tested with (5.17 through 5.24; a newer one is patched as far as its layer forwards can be verified).
# The oldest is installed; the newest goes into its own directory, without its dependencies (the
# oldest's satisfy it), put first on PYTHONPATH for a second run of tests/test_hf.py alone.
TRANSFORMERS_VERSION ?= 5.17.0
TRANSFORMERS_NEWEST ?= 5.24.0
TRANSFORMERS_NEWEST_DIR ?= build/transformers-$(TRANSFORMERS_NEWEST)
# tests/test_torchrec.py also runs against real TorchRec objects when torchrec imports. torchrec
# depends on fbgemm-gpu, whose CUDA build does not load without a GPU: install torchrec without its
# dependencies, then the CPU build of fbgemm and torchrec's other needs.
TORCHREC_VERSION ?= 1.9.2
FBGEMM_VERSION ?= 1.9.0
export MAX_JOBS ?= 2

.PHONY: run test deps test-deps build

deps:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "torch==$(TORCH_VERSION)"
	@$(PYTHON) -c "import setuptools, wheel, ninja" 2>/dev/null || $(PIP) install setuptools wheel ninja

test-deps: deps
	@$(PYTHON) -c "import pytest, numpy" 2>/dev/null || $(PIP) install pytest numpy
	@$(PYTHON) -c "import transformers as t; assert t.__version__ == '$(TRANSFORMERS_VERSION)'" 2>/dev/null || \
		$(PIP) install "transformers==$(TRANSFORMERS_VERSION)"
	@test -d $(TRANSFORMERS_NEWEST_DIR)/transformers || \
		$(PIP) install -q --no-deps --target $(TRANSFORMERS_NEWEST_DIR) "transformers==$(TRANSFORMERS_NEWEST)"
	@$(PYTHON) -c "import torchrec" 2>/dev/null || { $(PIP) install --no-deps "torchrec==$(TORCHREC_VERSION)" && \
		$(PIP) install "fbgemm-gpu-cpu==$(FBGEMM_VERSION)" tensordict pyre-extensions torchmetrics tqdm; }

build: deps
	$(PIP) install --no-build-isolation --no-deps -e .

run: build
	$(PYTHON) -m torchfuse

test: test-deps build
	$(PYTHON) -m pytest tests -q
	PYTHONPATH=$(TRANSFORMERS_NEWEST_DIR) $(PYTHON) -c \
		"import transformers as t; assert t.__version__ == '$(TRANSFORMERS_NEWEST)', t.__version__"
	PYTHONPATH=$(TRANSFORMERS_NEWEST_DIR) $(PYTHON) -m pytest tests/test_hf.py -q
