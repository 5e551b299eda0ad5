"""``OpsRollup`` leaves metadata's state for the ``ops`` app's (ops migration 0001); no table changes.

State only (``SeparateDatabaseAndState`` with no database operations): the table
``metadata_ops_rollup`` and its rows stay where they are, now owned by ``ops.OpsRollup``.
"""
from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("metadata", "0012_partition_sessions"),
        ("ops", "0001_initial"),  # ops has taken the model over before metadata lets it go
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[migrations.DeleteModel(name="OpsRollup")],
        ),
    ]
