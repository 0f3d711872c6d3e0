# Every setup step lives here: a fresh Debian 12/13 machine (as root) needs only `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PYTHON ?= python3
# python3-venv/python3-dev: a vanilla Debian python3 needs them for the venv and systemd-python's build
# slurm-wlm/munge: the local Slurm cluster of tests/slurm (tests/support/slurm_cluster.py, make slurm-up)
# prometheus: promtool, for `promtool check metrics` on real scrapes and `promtool test rules` (tests/observability)
APT_PACKAGES := gcc pkg-config libsystemd-dev systemd-journal-remote systemd python3-venv python3-dev slurm-wlm munge prometheus
# systemd-container/debootstrap: the units under a real systemd, PID 1 of a systemd-nspawn container
# (tests/systemd/test_units_real_systemd.py) booted from a cached root file system (make nspawn-rootfs);
# iproute2: ss, for the controller's listen backlog there
APT_PACKAGES += systemd-container debootstrap iproute2
# python3-apt: Ansible's apt module (tests/ansible) runs under /usr/bin/python3; python3-systemd: the
# distribution's journal binding that the compiler-free rollout test's venvs see (--system-site-packages)
APT_PACKAGES += python3-apt python3-systemd
# chromium: the goodput report rendered by a real headless browser (tests/goodput/test_report_html.py)
APT_PACKAGES += chromium
# slurmdbd/mariadb-server/mariadb-client: Slurm's accounting for the goodput runs and AdminComment
# (tests/slurm/test_accounting.py starts its own mariadbd and slurmdbd, never the packages' services)
APT_PACKAGES += slurmdbd mariadb-server mariadb-client
# libslurm-dev/libc6-dev: pyslurm built against the host's own Slurm where that is 24.11 (Debian 13; make
# pyslurm-host); elsewhere only headers nothing builds against
APT_PACKAGES += libslurm-dev libc6-dev
# e2fsprogs: mkfs.ext4, for the ledger's file system turned read-only (tests/faults/test_hostile.py); not
# in a debootstrap minbase Debian 13 (the trixie root has none)
APT_PACKAGES += e2fsprogs
STAMP_APT := $(VENV)/.apt-stamp
STAMP_PIP := $(VENV)/.pip-stamp
# ml-goodput-measurement: the oracle of the goodput cross-check (tests/goodput/test_crosscheck.py), in a
# venv of its own so that its Google Cloud dependencies never enter healthd's
MLGP_VERSION := 0.2.3
MLGP_VENV := build/venv-mlgp
STAMP_MLGP := $(MLGP_VENV)/.stamp-$(MLGP_VERSION)
# state directory of the local test cluster started by `make slurm-up`
SLURM_ROOT ?= /tmp/healthd-slurm

.PHONY: all deps test demo demo-node bench clean lint slurm-up slurm-down
.PHONY: nspawn-rootfs mlgp-venv check coverage nhc slurm-roots test-matrix pyslurm-root pyslurm-host

all: test

$(STAMP_APT): Makefile
	@mkdir -p $(VENV)
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "apt: installing$$missing"; \
		export DEBIAN_FRONTEND=noninteractive; \
		guard=""; if [ ! -e /usr/sbin/policy-rc.d ]; then \
			printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && guard=1; fi; \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing; rc=$$?; \
		if [ -n "$$guard" ]; then rm -f /usr/sbin/policy-rc.d; fi; \
		[ $$rc -eq 0 ]; \
	fi
	@touch $@

$(STAMP_PIP): $(STAMP_APT) pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# compat: a plain .pth path entry; the default editable finder adds ~12 ms to every interpreter start (the hooks)
	$(PIP) install -q -e '.[test,inband]' --config-settings editable_mode=compat
	@touch $@

deps: $(STAMP_PIP)

$(STAMP_MLGP): $(STAMP_APT)
	@test -x $(MLGP_VENV)/bin/python || $(PYTHON) -m venv $(MLGP_VENV)
	$(MLGP_VENV)/bin/pip install -q ml-goodput-measurement==$(MLGP_VERSION)
	@touch $@

mlgp-venv: $(STAMP_MLGP)

# pytest-xdist: JOBS worker processes, each given whole modules (a module's cluster or fleet starts once), the
# longest first (tests/conftest.py orders them). The daemon tier mostly waits on real daemons, so three
# workers keep two cores busy; JOBS=0 runs the suite in one process.
JOBS ?= 3
XDIST = -n $(JOBS) --dist loadfile --no-loadscope-reorder

test: deps lint nspawn-rootfs mlgp-venv nhc slurm-roots pyslurm-root pyslurm-host
	$(PY) -m pytest -q $(XDIST)

# the version matrix alone: the real-cluster core (tests/matrix/core.py) with every other Slurm release
# of the matrix, each in its root file system (docs/testing.md)
test-matrix: deps slurm-roots pyslurm-root
	$(PY) -m pytest -q tests/matrix

# the inner loop: lint and every test that boots no daemon (`-m "not daemon"`: no Slurm, munged, controller,
# container, ansible, browser or DDP job; the tiers are in docs/testing.md); `make test` runs these and the rest
check: deps lint mlgp-venv
	$(PY) -m pytest -q $(XDIST) -m "not daemon"

# line coverage of healthd/ for one tier (MARK, a pytest -m expression; MARK= for the whole suite): a
# table of the files below 100% and build/coverage/index.html. Only the pytest process is measured: a
# tracer in the children would change what some tests check there (a child's own imports, its stderr
# under a file-size limit, how fast an agent exits), so code that runs only in a child (the CLI's
# entry points, the hooks as slurmd runs them) counts as missed.
MARK ?= not daemon
coverage: deps lint mlgp-venv $(if $(MARK),,nspawn-rootfs slurm-roots)
	COVERAGE_FILE=build/.coverage $(PY) -m pytest -q $(XDIST) $(if $(MARK),-m "$(MARK)") --cov=healthd \
		--cov-report=term:skip-covered --cov-report=html:build/coverage

lint: deps
	$(PY) -m ruff check healthd healthd_inband.py tests bench demo

# the container root file system for tests/systemd (debootstrap minbase of this machine's Debian
# release, ~200 MB, about a minute): built once under build/nspawn/, keyed by a hash of what it
# installs, a no-op while that is unchanged
nspawn-rootfs: deps
	$(PY) -m tests.systemd.nspawn build

# LBNL NHC for tests/nhc/test_real_nhc.py and bench/nhc.py: `git archive` source from ../shared/third_party
# (no registry serves it), sha256-checked, unpacked into build/nhc and run in place (tests/support/nhc.py);
# a no-op once unpacked, and a note (the tests skip) where the tarball is absent, as in a user's own clone
nhc: deps
	$(PY) -m tests.support.nhc build

# the root file systems of the Slurm version matrix (tests/support/slurm_roots.py): Debian bookworm (Slurm
# 22.05), trixie (24.11) and sid (26.05) but the host's own release, each a debootstrap minbase with that
# release's Slurm, munge, python3 and a venv of the test dependencies (a few minutes each); cached under
# build/slurm-roots/, keyed by a hash of what they install, a no-op while that is unchanged
slurm-roots: deps
	$(PY) -m tests.support.slurm_roots build

# pyslurm 24.11.0 in the trixie root's test venv, so that the matrix runs PyslurmBackend on a real pyslurm
# (tests/support/pyslurm_build.py): built from ../shared/third_party (sha256-checked; about 4 minutes on
# 2 cores), the wheel cached under build/pyslurm/ by source, recipe, Slurm and python, installed in
# seconds into a rebuilt root; a note where the tarball is absent (a user's own clone) or trixie is the host
pyslurm-root: slurm-roots
	$(PY) -m tests.support.pyslurm_build --matrix-root

# pyslurm 24.11.0 in the project's venv where the host's own Slurm is 24.11 (Debian 13, which has no trixie
# root), so that the host's suite runs PyslurmBackend on a real pyslurm: the same build as pyslurm-root, run
# here against libslurm-dev with the venv's python, the wheel cached under build/pyslurm/ and a stamp in the
# venv; a note and nothing else on another Slurm (Debian 12: the trixie root has it) or without the tarball
pyslurm-host: deps
	$(PY) -m tests.support.pyslurm_build --host-venv $(VENV)

# the fault drill: 4-node Slurm + an agent per node + healthd-controller in auto (demo/fault_drill.py)
demo: deps
	$(PY) demo/fault_drill.py

# the node agent alone on one simulated node (healthy -> user fault -> hardware faults)
demo-node: deps
	$(PY) demo/node_drill.py

bench: deps nhc pyslurm-root
	$(PY) bench/agent_tick.py
	$(PY) bench/agent_daemon.py
	$(PY) bench/kernel_lines.py
	$(PY) bench/hooks.py
	$(PY) bench/inband_client.py
	$(PY) bench/inband_detect.py
	$(PY) bench/inband_job.py
	$(PY) bench/inband_job.py --fraction 0.12
	$(PY) bench/controller_path.py
	$(PY) bench/controller_round.py
	$(PY) bench/xid_to_drain.py
	$(PY) bench/nhc.py
	$(PY) bench/slurm_backends.py
	$(PY) bench/slurm_backends.py --in-root trixie

# a real munged + slurmctld + 4 slurmd (node01..node04, gpu:4 each) on 127.0.0.1; prints SLURM_CONF
slurm-up: deps
	$(PY) -m tests.support.slurm_cluster up --root $(SLURM_ROOT)

slurm-down:
	$(PY) -m tests.support.slurm_cluster down --root $(SLURM_ROOT)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
