# Every setup step lives here: a fresh Debian 12/13 machine (as root) needs only `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PYTHON ?= python3
# python3-venv/python3-dev: a vanilla Debian python3 needs them for the venv and systemd-python's build
APT_PACKAGES := gcc pkg-config libsystemd-dev systemd-journal-remote systemd python3-venv python3-dev
STAMP_APT := $(VENV)/.apt-stamp
STAMP_PIP := $(VENV)/.pip-stamp

.PHONY: all deps test demo bench clean lint

all: test

$(STAMP_APT):
	@mkdir -p $(VENV)
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "apt: installing$$missing"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing; \
	fi
	@touch $@

$(STAMP_PIP): $(STAMP_APT) pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test]'
	@touch $@

deps: $(STAMP_PIP)

test: deps lint
	$(PY) -m pytest -q

lint: deps
	$(PY) -m ruff check healthd tests bench demo

demo: deps
	$(PY) demo/node_drill.py

bench: deps
	$(PY) bench/agent_tick.py
	$(PY) bench/kernel_lines.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
