import logging
from importlib import import_module

from django.apps import AppConfig, apps
from django.db.models.signals import post_migrate
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


def _create_configured_pools(sender: AppConfig, **kwargs: object) -> None:
    from .pools import sync_pools

    sync_pools(overwrite=False)


class FanoutConfig(AppConfig):
    name = "fanout"
    verbose_name = "Fan-out runs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)

        # Every installed app's fanouts.py registers its definitions, as admin.py does.
        discover_definitions()
        post_migrate.connect(_create_configured_pools, sender=self)
        from . import telemetry

        if telemetry.available:
            from .signals import run_finished

            # A run's span is recorded when it ends, by whichever process ended it.
            run_finished.connect(telemetry.on_run_finished, dispatch_uid="fanout.telemetry")
