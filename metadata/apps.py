from django.apps import AppConfig


class MetadataConfig(AppConfig):
    name = "metadata"
    verbose_name = "Metadata store"

    def ready(self) -> None:
        from metadata.sessions import state as session_state  # noqa: F401  (cache invalidation on Session save/delete)
