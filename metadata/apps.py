from django.apps import AppConfig
from django.core import checks
from django.db.models.signals import post_migrate


class MetadataConfig(AppConfig):
    name = "metadata"
    verbose_name = "Metadata store"

    def ready(self) -> None:
        from metadata.checks import check_cache_configuration, check_partition_policy
        from metadata.partitions.post_migrate import make_partitions_after_migrate
        from metadata.sessions import state as session_state  # noqa: F401  (cache invalidation on Session save/delete)

        checks.register(check_partition_policy, "partitions")
        checks.register(check_cache_configuration, checks.Tags.caches)
        post_migrate.connect(make_partitions_after_migrate, sender=self, dispatch_uid="metadata.make_partitions_ahead")
