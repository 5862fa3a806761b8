# Idempotent setup and the project's two everyday commands: `make demo` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: install system-deps test demo clean

install: system-deps $(STAMP)

# Debian packages the services and tests need (Redis server, Chromium). Skipped when already present.
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (apt)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server >/dev/null; }
	@command -v redis-server >/dev/null 2>&1 || { echo "redis-server missing: install Debian's redis-server"; exit 1; }
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing chromium (apt; the dashboard's browser smoke test)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: the local CPU wheel, never a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,peers]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

test: install
	$(VENV)/bin/pytest $(PYTEST_ARGS)

demo: install
	$(VENV)/bin/astec demo

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
