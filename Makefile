# Two entry points for a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# Two processes, a test file each at a time (a file's Ray cluster and servers stay in one):
# most of a test's time is waiting on Ray, servers and subprocesses, not computing, so on the
# CI's two cores two processes overlap those waits.
PYTEST_ARGS ?= -q -n 2 --dist loadfile

.PHONY: install serve test bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch; a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The tests start a throwaway PostgreSQL server (tests/postgres_server.py), so its programs
	# must be here; Debian keeps them off PATH, under /usr/lib/postgresql/<major>/bin. A stale
	# package index (a fresh image) makes the first install fail: update, then try again.
	@if ! command -v initdb >/dev/null 2>&1 && \
			! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
		sudo=; if [ "$$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then sudo=sudo; fi; \
		apt="$$sudo env DEBIAN_FRONTEND=noninteractive apt-get"; \
		$$apt install -y -q postgresql || \
			{ $$apt update -q && $$apt install -y -q postgresql; } || \
			{ echo "error: the tests need PostgreSQL's server (initdb, pg_ctl, postgres)" >&2; \
			  exit 1; }; \
	fi
	touch $@

serve: install
	$(VENV)/bin/pd-runtime serve

# Tests run in a private network namespace with only loopback up, so Ray binds 127.0.0.1 and
# nothing can reach the network; where unshare is not permitted they run as they are.
test: install
	@if unshare -n true 2>/dev/null; then \
		unshare -n sh -c 'ip link set lo up 2>/dev/null; exec $(PY) -m pytest $(PYTEST_ARGS)'; \
	else \
		echo "note: unshare -n not permitted here; running tests without a network namespace"; \
		$(PY) -m pytest $(PYTEST_ARGS); \
	fi

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
