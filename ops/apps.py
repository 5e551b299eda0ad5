from django.apps import AppConfig


class OpsConfig(AppConfig):
    """Operator views of the whole platform: the dashboard, its rollups and gauges."""

    name = "ops"
    verbose_name = "Operations"

    def ready(self) -> None:
        from ops import tasks  # noqa: F401  (its beat tasks must be known wherever beat jobs are routed)
