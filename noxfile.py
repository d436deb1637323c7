"""The test matrix: the suite on every supported Django and Python, against real services.

    nox -l                                        # the sessions
    nox -s "tests-3.13(django='5.2')"             # the full suite on one combination
    nox -s "quick-3.12(django='6.1')"             # the reduced suite (what CI runs on the other)
    nox -s "tests-3.13(django='6.1')" -- -k claim # extra arguments go to pytest

Every session reads DATABASE_URL and REDIS_URL as `make test` does (PostgreSQL and Redis on
127.0.0.1 by default) and starts them with scripts/services.sh when they are down.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

DJANGO = {"5.2": "Django>=5.2,<5.3", "6.0": "Django>=6.0,<6.1", "6.1": "Django>=6.1,<6.2"}
PYTHON = ["3.12", "3.13"]

# Test files run in this many pytest processes at once, as `make test` runs them (most tests
# wait on worker processes and leases, not on the CPU).
PROCESSES = ["-n", os.environ.get("TEST_PROCESSES", "3"), "--dist", "loadfile"]

# The reduced suite: every module except the slow process-racing, browser and chaos ones,
# plus one real RQ worker test and the fresh-project install test.
QUICK = [
    "tests/test_install.py",  # the longest: first, so that it starts first
    "tests/test_command.py",
    "tests/test_definition.py",
    "tests/test_checks.py",
    "tests/test_claim.py",
    "tests/test_materialize.py",
    "tests/test_run_lifecycle.py",
    "tests/test_sqlite.py",
    "tests/test_thresholds.py",
    "tests/test_groups.py",
    "tests/test_nesting.py",
    "tests/test_compensation.py",
    "tests/test_history_and_signals.py",
    "tests/admin",
    "tests/pools/test_config.py",
    "tests/rq/test_drain_jobs.py",
    "--ignore=tests/admin/test_browser.py",
]


def _select_pyenv_versions() -> None:
    """pyenv's python3.12/python3.13 shims run only the versions selected: select them."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    if "PYENV_VERSION" in os.environ or not (root / "versions").is_dir():
        return
    newest = [sorted(v.name for v in (root / "versions").glob(f"{m}.*"))[-1:] for m in PYTHON]
    if all(newest):
        os.environ["PYENV_VERSION"] = ":".join(v for [v] in newest)


_select_pyenv_versions()
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests-3.13(django='6.1')", "quick-3.12(django='5.2')"]


def _install(session: nox.Session, django: str) -> dict[str, str]:
    extras = "dev,mysql" if os.environ.get("DATABASE_URL", "").startswith("mysql") else "dev"
    session.install("-e", f".[{extras}]", DJANGO[django])
    session.run("python", "-c", "import django; print('Django', django.get_version())")
    env = {
        "DATABASE_URL": os.environ.get("DATABASE_URL", "postgres://root@127.0.0.1:5432/test"),
        "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
    }
    session.run("scripts/services.sh", env=env, external=True)
    return env


@nox.session(python=PYTHON)
@nox.parametrize("django", list(DJANGO))
def tests(session: nox.Session, django: str) -> None:
    """The whole suite."""
    env = _install(session, django)
    session.run("python", "-m", "pytest", *PROCESSES, *session.posargs, env=env)


@nox.session(python=PYTHON)
@nox.parametrize("django", list(DJANGO))
def quick(session: nox.Session, django: str) -> None:
    """A reduced but real suite: real PostgreSQL, Redis and worker processes, minutes less."""
    env = _install(session, django)
    session.run("python", "-m", "pytest", *PROCESSES, *QUICK, *session.posargs, env=env)
    session.run("python", "manage.py", "check", "--fail-level", "ERROR", env=env)
    session.run("python", "manage.py", "makemigrations", "--check", "--dry-run", env=env)
