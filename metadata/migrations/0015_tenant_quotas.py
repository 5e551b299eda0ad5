"""Tenant quotas: a tenant's own limits of live generations and open streams, and the
index that counts a tenant's live sessions cheaply.

``session_tenant_live`` is a partial index of the sessions queued or running, by tenant: the
quota's count (``sessions.submission.admission``) reads only the tenant's live rows,
never its finished ones (with the tenant-recent index alone, the planner reads every session of
the tenant in every partition and filters them). It is made on the partitioned parent, so every
partition has it, and ``metadata.partitions.ddl.build_parent_indexes`` copies it onto new ones.
It is SQL of this migration, not in ``Session.Meta``.
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('metadata', '0014_rename_beat_tasks'),
    ]

    operations = [
        migrations.AddField(
            model_name='tenant',
            name='max_live_generations',
            field=models.PositiveIntegerField(blank=True, help_text='generations queued or running at once (empty: SPECOPS_TENANT_MAX_LIVE_GENERATIONS; 0: no limit)', null=True),
        ),
        migrations.AddField(
            model_name='tenant',
            name='max_open_streams',
            field=models.PositiveIntegerField(blank=True, help_text='session streams open at once (empty: SPECOPS_TENANT_MAX_OPEN_STREAMS; 0: no limit)', null=True),
        ),
        migrations.RunSQL(
            "CREATE INDEX IF NOT EXISTS session_tenant_live ON metadata_session (tenant_id) "
            "WHERE status IN ('queued', 'running')",
            reverse_sql="DROP INDEX IF EXISTS session_tenant_live",
        ),
    ]
