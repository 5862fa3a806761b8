# Idempotent setup and the project's everyday commands: `make demo`, `make test`, `make lint`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
# Apache Kafka's broker jars, pinned by infra/kafka/pom.xml and copied by Maven into a classpath
KAFKA_LIB   := infra/kafka/lib
KAFKA_STAMP := $(KAFKA_LIB)/.resolved-$(shell cat infra/kafka/pom.xml | sha1sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: install system-deps java-deps test lint demo clean peers-pecos

install: system-deps java-deps $(STAMP) $(KAFKA_STAMP)
	@echo "installed: run $(VENV)/bin/astec, or '. $(VENV)/bin/activate' and then astec"

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

# Java >= 17 and Maven run and resolve the Kafka broker; apt-installed when missing (as root or
# with sudo), otherwise one line says what to install.
java-deps:
	@command -v java >/dev/null 2>&1 && command -v mvn >/dev/null 2>&1 || { \
	  echo "installing openjdk-17-jre-headless and maven (apt; the local Kafka broker)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq openjdk-17-jre-headless maven >/dev/null; } || true
	@command -v java >/dev/null 2>&1 || { echo "java not found: install OpenJDK 17 or later (Debian: apt-get install openjdk-17-jre-headless)"; exit 1; }
	@java -version 2>&1 | awk -F'"' '/version/ { split($$2, v, "."); if (v[1] + 0 < 17) { print "java " $$2 " is too old: Apache Kafka 4 needs Java 17 or later (Debian: apt-get install openjdk-17-jre-headless)"; exit 1 } }'
	@command -v mvn >/dev/null 2>&1 || { echo "mvn not found: install Maven 3.8 or later (Debian: apt-get install maven)"; exit 1; }

$(KAFKA_STAMP): infra/kafka/pom.xml
	rm -rf $(KAFKA_LIB).tmp
	mvn -q -B -f infra/kafka/pom.xml dependency:copy-dependencies -DincludeScope=runtime \
	  -DoutputDirectory=$(CURDIR)/$(KAFKA_LIB).tmp
	rm -rf $(KAFKA_LIB) && mv $(KAFKA_LIB).tmp $(KAFKA_LIB)
	touch $@

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned. With no local CPU wheel (pip config's find-links), PyPI's Linux
	# build comes with the CUDA 13 runtime wheels it loads at import even on CPU: ~4.5 GB in all.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[all,dev,peers]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

test: install
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# Lint, format check and type check of the whole repository (config: pyproject.toml [tool.*]).
# Needs only the venv, not the services, so it depends on the Python install stamp alone.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

demo: install
	$(VENV)/bin/astec demo

# PECOS XR-Linear's own environment (.venv-pecos/, ~15 s of pip) for `astec bench peers --methods
# ...,pecos` and `astec bench predict --systems ...,pecos`: libpecos caps numpy and scipy below the
# project's, so it never enters $(VENV). The benches also make it on first use.
peers-pecos: $(STAMP)
	$(PY) -m bench.pecos_peer

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache $(KAFKA_LIB)
