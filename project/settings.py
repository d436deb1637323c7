"""Settings of the example project that hosts the `fanout` app.

Configuration comes from the environment:
  DATABASE_URL   sqlite:///path (default: db.sqlite3 beside manage.py), postgres://..., mysql://...
  REDIS_URL      redis://127.0.0.1:6379/0 by default; used by django-rq
  SECRET_KEY, DEBUG, FANOUT_LOG_LEVEL, FANOUT_TEST_DATABASE_NAME
"""

import os
from pathlib import Path

import dj_database_url

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

DATABASE_URL = os.environ.get("DATABASE_URL") or f"sqlite:///{BASE_DIR / 'db.sqlite3'}"

# dj-database-url reads sqlite:///relative (to the working directory), sqlite:////absolute,
# postgres://, mysql:// (MariaDB too), with query parameters as OPTIONS.
DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_health_checks=True)}

if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Serialised writers that readers do not block: what fanout's threads need (check W004).
    DATABASES["default"]["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": 20,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        **DATABASES["default"].get("OPTIONS", {}),
    }
if os.environ.get("FANOUT_TEST_DATABASE_NAME"):
    DATABASES["default"]["TEST"] = {"NAME": os.environ["FANOUT_TEST_DATABASE_NAME"]}


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
# The name this machine goes by in owners and per-host limits (default: its hostname).
FANOUT_HOST_NAME = os.environ.get("FANOUT_HOST_NAME") or None

# The LLM sweep's providers: their token rates match the fake providers' own limits (so none
# answers 429), and each has a monthly budget.
LLM_BUDGET = {"usd": 5, "period": "month"}
LLM_PROVIDER = {"max_concurrency": 6, "rate": "4000 tokens/s", "budget": LLM_BUDGET}
FANOUT_POOLS = {
    "thumbnailer": {"max_concurrency": 3, "rate": "20/s"},
    "llm-acme": LLM_PROVIDER,
    "llm-orbit": LLM_PROVIDER,
}
