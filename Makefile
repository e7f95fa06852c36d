# One place for the commands the README and CI use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint typecheck redis clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q -e ".[server,client,dev,telemetry,flower]"

# The main job: a real server on an embedded broker with a tiny local model, and a client training against it.
demo: install
	$(BIN)/python -m twinkle.demo

# Redis for the tests: the machine's own at 127.0.0.1:6379, or one started here if it is not running.
redis:
	@$(BIN)/python -c "import redis; redis.Redis(socket_connect_timeout=1).ping()" 2>/dev/null || \
	  (redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no && sleep 1)

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy twinkle twinkle_client api workers

test: install redis lint
	$(BIN)/python -m pytest -q -ra

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
