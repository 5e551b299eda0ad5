from django.apps import AppConfig


class SpecOpsConfig(AppConfig):
    name = "specops"
    verbose_name = "SpecOps"

    def ready(self) -> None:
        from specops import (
            checks,  # noqa: F401  (registers the system checks)
            tasks,  # noqa: F401  (its beat task must be known wherever beat jobs are routed)
        )
