from django.apps import AppConfig


class CoreConfig(AppConfig):
    """What every app uses; an app only so its system checks are registered once."""

    name = "core"
    verbose_name = "SpecOps core"

    def ready(self) -> None:
        from core import checks  # noqa: F401  (registers the configuration check)
