"""``OpsRollup`` leaves metadata's state for the ``ops`` app's (ops migration 0001); no table changes.

State only (``SeparateDatabaseAndState`` with no database operations): the table
``metadata_ops_rollup`` and its rows stay where they are, now owned by ``ops.OpsRollup``.
Ops migration 0001, which takes the model over, runs before this one: it says so itself
(``run_before``), as this app names no app above it.
"""
from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("metadata", "0012_partition_sessions"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[migrations.DeleteModel(name="OpsRollup")],
        ),
    ]
