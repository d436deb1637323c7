from django.apps import AppConfig
from django.db.models.signals import post_migrate
from django.utils.module_loading import autodiscover_modules


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
        autodiscover_modules("fanouts")
        post_migrate.connect(_create_configured_pools, sender=self)
