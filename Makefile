# fanout: development tasks. `make demo` runs the example project, `make test` the test suite.

VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# Services used by the tests; override on the command line or in the environment.
TEST_DATABASE_URL ?= postgres://root@127.0.0.1:5432/test
TEST_REDIS_URL    ?= redis://127.0.0.1:6379/0
PYTEST_ARGS ?=

.PHONY: venv demo test lint clean

venv: $(STAMP)

# Reinstall when the dependencies change, or once the package first appears.
$(STAMP): pyproject.toml $(wildcard fanout/__init__.py)
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
	$(PY) -m pip install -qq -e '.[dev]'
	@touch $@

# DATABASE_URL is passed through as given; unset means SQLite (db.sqlite3) from the settings.
demo: venv
	$(PY) manage.py migrate --noinput -v0
	$(PY) manage.py run_fanout thumbnails

test: export DATABASE_URL ?= $(TEST_DATABASE_URL)
test: export REDIS_URL ?= $(TEST_REDIS_URL)
test: venv
	scripts/services.sh
	$(PY) -m pytest $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) db.sqlite3 db.sqlite3-wal db.sqlite3-shm build dist *.egg-info
	find . -name __pycache__ -type d -not -path './.git/*' -prune -exec rm -rf {} +
	rm -rf .pytest_cache .ruff_cache .mypy_cache
