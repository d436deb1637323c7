"""Settings of the example project that hosts the `fanout` app.

Configuration comes from the environment:
  DATABASE_URL   sqlite:///path (default: db.sqlite3 beside manage.py), postgres://..., mysql://...
  REDIS_URL      redis://127.0.0.1:6379/0 by default; used by django-rq
  SECRET_KEY, DEBUG, FANOUT_LOG_LEVEL, FANOUT_TEST_DATABASE_NAME
"""

import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get(
    "SECRET_KEY", "django-insecure-fanout-dev-key-change-me-in-production-0123456789"
)

DEBUG = os.environ.get("DEBUG", "1").strip().lower() not in {"0", "false", "no", "off", ""}

ALLOWED_HOSTS: list[str] = (
    ["*"]
    if DEBUG
    else [h.strip() for h in os.environ.get("ALLOWED_HOSTS", "").split(",") if h.strip()]
)


# ------------------------------------------------------------------ database

_SQLITE_OPTIONS = {
    "transaction_mode": "IMMEDIATE",
    "timeout": 20,
    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
}

_ENGINES = {
    "postgres": "django.db.backends.postgresql",
    "postgresql": "django.db.backends.postgresql",
    "pgsql": "django.db.backends.postgresql",
    "mysql": "django.db.backends.mysql",
}


def parse_database_url(url: str, base_dir: Path = BASE_DIR) -> dict[str, Any]:
    """Turn a database URL into a Django DATABASES entry.

    As in dj-database-url: sqlite:///relative/path is relative to base_dir,
    sqlite:////abs/path (four slashes) is absolute, sqlite://:memory: is in memory.
    postgres://, postgresql:// and mysql:// take user:password@host:port/name, and
    query parameters become OPTIONS.
    """
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep:
        raise ImproperlyConfigured(
            f"DATABASE_URL {url!r} is not a URL: use sqlite:///path, "
            "postgres://user:pass@host:port/name or mysql://user:pass@host:port/name"
        )

    if scheme == "sqlite":
        path = rest.split("?", 1)[0]
        if path in {":memory:", "/:memory:"}:
            name: str = ":memory:"
        else:
            if path.startswith("/"):
                path = path[1:]  # sqlite:///x -> "x"; sqlite:////abs -> "/abs"
            if not path:
                raise ImproperlyConfigured(f"DATABASE_URL {url!r} names no SQLite file")
            p = Path(unquote(path))
            name = str(p if p.is_absolute() else base_dir / p)
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": name,
            "OPTIONS": dict(_SQLITE_OPTIONS),
        }

    engine = _ENGINES.get(scheme)
    if engine is None:
        raise ImproperlyConfigured(
            f"DATABASE_URL scheme {scheme!r} is not supported: "
            "use sqlite://, postgres:// (or postgresql://) or mysql://"
        )
    parts = urlsplit(url)
    config: dict[str, Any] = {
        "ENGINE": engine,
        "NAME": unquote(parts.path.lstrip("/")),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }
    options = dict(parse_qsl(parts.query))
    if options:
        config["OPTIONS"] = options
    if engine == "django.db.backends.postgresql":
        config["CONN_HEALTH_CHECKS"] = True
        test_name = os.environ.get("FANOUT_TEST_DATABASE_NAME")
        if test_name:
            config["TEST"] = {"NAME": test_name}
    return config


DATABASE_URL = os.environ.get("DATABASE_URL") or f"sqlite:///{BASE_DIR / 'db.sqlite3'}"

DATABASES = {"default": parse_database_url(DATABASE_URL)}


# --------------------------------------------------------------------- redis

REDIS_URL = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"

RQ_QUEUES = {
    # fanout's drain jobs carry only ids, as JSON.
    "fanout": {
        "URL": REDIS_URL,
        "DEFAULT_TIMEOUT": 3600,
        "SERIALIZER": "rq.serializers.JSONSerializer",
    },
    # Definitions with requires="gpu" go here; only `rqworker fanout-gpu` workers run them.
    "fanout-gpu": {
        "URL": REDIS_URL,
        "DEFAULT_TIMEOUT": 3600,
        "SERIALIZER": "rq.serializers.JSONSerializer",
    },
    "default": {"URL": REDIS_URL},
}


# `manage.py rqworker fanout` runs drain jobs in-process, with a graceful SIGTERM.
RQ = {"WORKER_CLASS": "fanout.rq.FanoutWorker"}


# ---------------------------------------------------------------- django apps

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_rq",
    "django_filters",
    "fanout",
    "project.demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "project.wsgi.application"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "static"

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"


# ------------------------------------------------------------------- logging

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "plain"},
    },
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {
        "fanout": {
            "handlers": ["console"],
            "level": os.environ.get("FANOUT_LOG_LEVEL", "WARNING").upper(),
            "propagate": False,
        },
    },
}


# -------------------------------------------------------------------- fanout

# The capacity pool used by the demo definition (project/demo/fanouts.py).
FANOUT_POOLS = {
    "thumbnailer": {"max_concurrency": 3, "rate": "20/s"},
}
