from django.apps import AppConfig
from django.core import checks
from django.db.models.signals import post_migrate


class MetadataConfig(AppConfig):
    name = "metadata"
    verbose_name = "Metadata store"

    def ready(self) -> None:
        from core.beat_jobs import declare_jobs
        from metadata.api.authentication import connect_invalidation as connect_token_cache_invalidation
        from metadata.archival import PartitionArchiver
        from metadata.checks import check_cache_configuration, check_partition_policy
        from metadata.partitions.archiving import register_archiver
        from metadata.partitions.beat_jobs import periodic_jobs
        from metadata.partitions.post_migrate import make_partitions_after_migrate

        declare_jobs("metadata", periodic_jobs)
        connect_token_cache_invalidation()  # a token, its user, membership or tenant changed
        register_archiver(PartitionArchiver)  # the rotation archives through it; partitions never imports archival
        checks.register(check_partition_policy, "partitions")
        checks.register(check_cache_configuration, checks.Tags.caches)
        post_migrate.connect(make_partitions_after_migrate, sender=self, dispatch_uid="metadata.make_partitions_ahead")
