from django.apps import AppConfig
from django.db.models.signals import post_migrate

from . import launch
from .discover import discover_definitions
from .signals import run_finished


def _create_configured_pools(sender: AppConfig, **kwargs: object) -> None:
    from .pools import sync_pools

    sync_pools(overwrite=False)


class FanoutConfig(AppConfig):
    name = "fanout"
    verbose_name = "Fan-out runs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Django imports this module before the models load: the modules that use them are
        # imported here, once they have (importing checks registers the system checks).
        from . import checks, dispatch, telemetry  # noqa: F401

        # The layers below dispatch start runs through launch (FanOut.start, Item.spawn).
        launch.connect(dispatch.LAUNCHER)

        # Every installed app's fanouts.py registers its definitions, as admin.py does.
        discover_definitions()
        post_migrate.connect(_create_configured_pools, sender=self)
        if telemetry.available:
            # A run's span is recorded when it ends, by whichever process ended it.
            run_finished.connect(telemetry.on_run_finished, dispatch_uid="fanout.telemetry")
