# fanout: development tasks. `make demo` runs the example project, `make test` the test suite,
# `make test-mariadb` the process-racing tests on MariaDB, `make matrix` every supported Django,
# `make docs` the documentation site.

VENV   := .venv
PY     := $(VENV)/bin/python
# Two installs: the demo's (the package and the example project's one extra) and the rest of
# the development environment (tests, browser, nox, mypy, the mysql extra), which only
# `make test` and its kin need.
DEMO_STAMP := $(VENV)/.demo
STAMP      := $(VENV)/.installed

# Services used by the tests; override on the command line or in the environment.
TEST_DATABASE_URL ?= postgres://root@127.0.0.1:5432/test
TEST_REDIS_URL    ?= redis://127.0.0.1:6379/0
TEST_MYSQL_URL    ?= mysql://root@127.0.0.1:3306/test
PYTEST_ARGS ?=

# What must hold on MariaDB as on PostgreSQL: racing parents and workers run every item once,
# a SIGKILLed owner's item is reclaimed, limits stay exact across processes, and the model of
# transitions (tests/test_model.py) holds every invariant there too, and the run page's counts
# read one index (tests/test_progress_plans.py); the spending hand-over procedure settles, refuses
# and rolls budget periods as PostgreSQL's function does, in the claims' lock order (tests/spend).
RACING_TESTS := tests/test_model.py tests/test_processes.py tests/pools/test_concurrency.py tests/rq/test_workers.py \
	tests/test_slots.py tests/test_clock_skew.py tests/test_host_limit.py \
	tests/rq/test_supervision.py tests/test_nesting.py tests/test_compensation.py \
	tests/test_mariadb_clock.py tests/test_mariadb_collation.py tests/test_permanent_errors.py \
	tests/test_retry_race.py tests/test_host_lock.py tests/test_model_findings.py \
	tests/test_counters.py tests/pools/test_rate_overspend.py tests/test_hand_over.py \
	tests/rq/test_stuck_runs.py tests/test_prune.py tests/test_results.py \
	tests/test_admission_agreement.py tests/test_progress_plans.py \
	tests/spend/test_hand_over.py tests/spend/test_review_periods.py tests/spend/test_gate_clock.py \
	tests/spend/test_lock_order.py

.PHONY: venv demo demo-llm test test-mariadb matrix docs lint clean

venv: $(STAMP)

# The virtualenv on a Python >= 3.12: recreated when it uses an older (or a broken) one.
define MAKE_VENV
	@if [ -x $(PY) ] && ! $(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then \
		echo "$(VENV) uses a Python older than 3.12 (or a broken one): recreating it"; \
		rm -rf $(VENV); \
	fi
	@if [ ! -x $(PY) ]; then \
		python=$$(scripts/find-python) || exit 1; \
		echo "creating $(VENV) with $$python"; \
		"$$python" -m venv $(VENV) || exit 1; \
	fi
	$(PY) -m pip install -qq --upgrade pip
endef

# Reinstall when the dependencies change, or once the package first appears.
# The demo: the package and the example extra only; never apt-get.
$(DEMO_STAMP): pyproject.toml $(wildcard fanout/__init__.py)
	$(MAKE_VENV)
	$(PY) -m pip install -qq -e ".[example]"
	@touch $@

# Everything else the tests need (a superset of the demo's install).
$(STAMP): pyproject.toml $(wildcard fanout/__init__.py)
	$(MAKE_VENV)
	@# The mysql extra (mysqlclient) compiles against system packages: install them if we can.
	@if scripts/mysql-build-deps.sh; then extras=dev,mysql; else \
		echo "installing without the mysql extra: make test-mariadb will not run"; extras=dev; fi; \
	echo "$(PY) -m pip install -qq -e '.[$$extras]'"; \
	$(PY) -m pip install -qq -e ".[$$extras]"
	@touch $@ $(DEMO_STAMP)

# DATABASE_URL is passed through as given; unset means SQLite (db.sqlite3) from the settings.
demo: $(DEMO_STAMP)
	$(PY) manage.py migrate --noinput -v0
	$(PY) manage.py run_fanout thumbnails

# The LLM sweep (docs/budgets.md): token-rate pools with budgets over fake providers, SQLite.
demo-llm: $(DEMO_STAMP)
	$(PY) manage.py migrate --noinput -v0
	$(PY) manage.py fanout_pools --sync
	$(PY) manage.py run_fanout llm_sweep

# `make test` runs the suite in TEST_PROCESSES pytest processes (pytest-xdist, one test file
# per process at a time): most tests wait on worker processes, leases and the database more
# than on the CPU. The longest files are named first so that they start first. Each process
# makes its own test database and takes a Redis database of its own. With PYTEST_ARGS, one
# pytest runs what they select.
TEST_PROCESSES ?= 3
LONGEST_TESTS := tests/test_model.py tests/test_chaos.py tests/test_install.py

test: export DATABASE_URL ?= $(TEST_DATABASE_URL)
test: export REDIS_URL ?= $(TEST_REDIS_URL)
test: venv
	scripts/services.sh
	scripts/test-deps.sh
ifeq ($(strip $(PYTEST_ARGS)),)
	$(PY) -m pytest -n $(TEST_PROCESSES) --dist loadfile $(LONGEST_TESTS) tests
else
	$(PY) -m pytest $(PYTEST_ARGS)
endif

test-mariadb: export DATABASE_URL = $(TEST_MYSQL_URL)
test-mariadb: export REDIS_URL ?= $(TEST_REDIS_URL)
test-mariadb: venv
	scripts/services.sh
	scripts/test-deps.sh
	$(PY) -m pytest -n $(TEST_PROCESSES) --dist loadfile $(RACING_TESTS) $(PYTEST_ARGS)

# Every supported Django on Python 3.12 and 3.13 (nox -l lists the sessions).
matrix: venv
	$(VENV)/bin/nox -s tests

# The documentation site from docs/*.md (and the README, its front page); a warning (a broken
# link or anchor, a missing image, a page outside the table of contents) fails the build.
DOCS_OUT ?= docs/_build/html
docs: venv
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html docs $(DOCS_OUT)
	@echo "the docs are in $(DOCS_OUT)/index.html"

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) db.sqlite3 db.sqlite3-wal db.sqlite3-shm build dist *.egg-info docs/_build
	find . -name __pycache__ -type d -not -path './.git/*' -prune -exec rm -rf {} +
	rm -rf .pytest_cache .ruff_cache .mypy_cache .nox
