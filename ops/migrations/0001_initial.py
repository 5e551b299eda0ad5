"""The operators' rollups become this app's model, in state only: the table stays as it is.

``metadata_ops_rollup`` was created by metadata migration 0006 (then metadata's ``OpsRollup``);
this migration records the same model under ``ops`` without touching the database, and metadata
migration 0013 drops it from metadata's state, also without touching the database. So a fresh
database gets the table from metadata 0006, and an existing one keeps its rows.
"""
import django.contrib.postgres.fields
import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ("metadata", "0006_ops_rollup"),  # the table exists once that ran
    ]
    # ops has taken the model over before metadata lets it go; said here, so metadata names no app above it
    run_before = [
        ("metadata", "0013_ops_rollup_moves_to_ops"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.CreateModel(
                    name="OpsRollup",
                    fields=[
                        ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False,
                                                   verbose_name="ID")),
                        ("start", models.DateTimeField()),
                        ("width", models.PositiveSmallIntegerField(choices=[(1, "minute"), (60, "hour")], default=1)),
                        ("series", models.CharField(max_length=24)),
                        ("key", models.CharField(blank=True, default="", max_length=100)),
                        ("count", models.BigIntegerField(default=0)),
                        ("total", models.FloatField(default=0.0)),
                        ("buckets", django.contrib.postgres.fields.ArrayField(
                            base_field=models.BigIntegerField(), blank=True, default=list, size=None)),
                        ("values", models.JSONField(blank=True, default=dict)),
                        ("updated_at", models.DateTimeField(default=django.utils.timezone.now)),
                    ],
                    options={
                        "db_table": "metadata_ops_rollup",
                        "indexes": [models.Index(fields=["width", "start"], name="ops_rollup_by_time")],
                        "constraints": [models.UniqueConstraint(fields=("width", "series", "key", "start"),
                                                                name="ops_rollup_one_per_slot")],
                    },
                ),
            ],
        ),
    ]
