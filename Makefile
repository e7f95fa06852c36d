# One place for the commands the README and CI use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install install-demo demo test lint typecheck redis browser clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Everything, for the tests and development (megatron-core, Ray, the linters, ...).
install: $(BIN)/python
	$(BIN)/pip install -q -e ".[server,client,dev,telemetry,flower]"

# Only what the demo runs: the server and the Tinker SDK; pip shows its progress (the first run downloads torch).
$(VENV)/.demo-installed: pyproject.toml | $(BIN)/python
	@echo "Installing the server and client into $(VENV) (the first time downloads torch: a few minutes)"
	$(BIN)/pip install --progress-bar on -e ".[server,client]"
	@touch $@

install-demo: $(VENV)/.demo-installed

# The main job: a real server on an embedded broker with a tiny local model, and a client training against it.
demo: install-demo
	$(BIN)/python -m twinkle.demo

# Redis for the tests: the machine's own at 127.0.0.1:6379, or one started here if it is not running.
redis:
	@$(BIN)/python -c "import redis; redis.Redis(socket_connect_timeout=1).ping()" 2>/dev/null || \
	  (redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no && sleep 1)

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy twinkle twinkle_client api workers

# Chromium for the console's browser tests (Debian's package, about 290 MB, installed with apt as root;
# Playwright drives it, never downloads one). `make test SKIP_BROWSER=1` installs nothing and deselects them.
SKIP_BROWSER ?=
browser:
ifeq ($(SKIP_BROWSER),1)
	@echo "SKIP_BROWSER=1: Chromium not installed; the console's browser tests are deselected"
else
	@test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
endif

test: install redis browser lint
	$(BIN)/python -m pytest -q -ra $(if $(filter 1,$(SKIP_BROWSER)),-m "not browser")

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
