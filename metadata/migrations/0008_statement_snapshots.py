"""pg_stat_statements snapshots (partitioned on taken_at, rotated and archived like the others) and
the baselines their deltas are computed against (metadata.insights.snapshots)."""
from django.db import migrations, models

from metadata.partitions.migration_operations import CreatePartitionedModel


class Migration(migrations.Migration):

    dependencies = [
        ("metadata", "0007_register_ops_rollup_job"),
    ]

    operations = [
        CreatePartitionedModel(
            partition_column="taken_at",
            name="StatementSnapshot",
            fields=[
                ("pk", models.CompositePrimaryKey("database", "queryid", "taken_at", blank=True, editable=False,
                                                  primary_key=True, serialize=False)),
                ("taken_at", models.DateTimeField()),
                ("interval_s", models.FloatField()),
                ("database", models.CharField(max_length=32)),
                ("queryid", models.BigIntegerField()),
                ("query", models.TextField()),
                ("family", models.CharField(max_length=100)),
                ("source", models.CharField(blank=True, default="", max_length=200)),
                ("calls", models.BigIntegerField()),
                ("total_time_ms", models.FloatField()),
                ("max_time_ms", models.FloatField()),
                ("rows", models.BigIntegerField()),
                ("shared_blks_hit", models.BigIntegerField()),
                ("shared_blks_read", models.BigIntegerField()),
                ("shared_blks_dirtied", models.BigIntegerField()),
                ("shared_blks_written", models.BigIntegerField()),
            ],
            options={
                "db_table": "metadata_statement_snapshot",
            },
        ),
        migrations.CreateModel(
            name="StatementBaseline",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("database", models.CharField(max_length=32)),
                ("queryid", models.BigIntegerField()),
                ("taken_at", models.DateTimeField()),
                ("query", models.TextField(blank=True, default="")),
                ("calls", models.BigIntegerField(default=0)),
                ("total_time_ms", models.FloatField(default=0.0)),
                ("max_time_ms", models.FloatField(default=0.0)),
                ("rows", models.BigIntegerField(default=0)),
                ("shared_blks_hit", models.BigIntegerField(default=0)),
                ("shared_blks_read", models.BigIntegerField(default=0)),
                ("shared_blks_dirtied", models.BigIntegerField(default=0)),
                ("shared_blks_written", models.BigIntegerField(default=0)),
            ],
            options={
                "constraints": [models.UniqueConstraint(fields=("database", "queryid"),
                                                        name="one_baseline_per_statement")],
            },
        ),
    ]
