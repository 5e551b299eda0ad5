"""``ModelVersion`` leaves this app's migration state: it is the metadata store's model now.

State only (``SeparateDatabaseAndState`` with no database operations): the table
``inference_modelversion`` and its rows stay as they are, owned by ``metadata.ModelVersion``
(metadata migration 0001 creates it on a new database; migration 0017 there carries its content
type, and with it the permissions staff hold on it, over to the store).
"""
from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("inference", "0006_idempotency_key"),
        ("metadata", "0017_model_version_content_type"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[migrations.DeleteModel(name="ModelVersion")],
        ),
    ]
