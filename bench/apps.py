from django.apps import AppConfig


class BenchConfig(AppConfig):
    name = "bench"
    label = "bench"
    verbose_name = "fanout benchmark"
    default_auto_field = "django.db.models.BigAutoField"
