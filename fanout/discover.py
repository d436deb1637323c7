"""Discover: every installed app's fanouts.py registers its definitions, as admin.py does."""

import logging
from importlib import import_module

from django.apps import apps
from django.utils.module_loading import module_has_submodule

logger = logging.getLogger("fanout")

# Apps whose fanouts.py raised on import: {module: "ErrorClass: message"}. A worker still
# starts, and says on every run it cannot run why (a deploy with a broken fanouts.py).
_import_errors: dict[str, str] = {}


def import_errors() -> dict[str, str]:
    return dict(_import_errors)


def discover_definitions() -> None:
    """Import every installed app's fanouts.py, as the admin does admin.py; note failures."""
    for config in apps.get_app_configs():
        if not module_has_submodule(config.module, "fanouts"):
            continue
        name = f"{config.name}.fanouts"
        try:
            import_module(name)
        except Exception as exc:
            logger.exception("%s failed to import: its fan-outs are unknown here", name)
            _import_errors[name] = f"{type(exc).__name__}: {exc}"
