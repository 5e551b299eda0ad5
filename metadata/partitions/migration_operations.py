"""A CreateModel that makes a RANGE-partitioned table (Django has no notion of partitioning).

The column list, primary key and indexes come from Django's own schema editor, so the table
matches the model exactly; only ``PARTITION BY RANGE (...)`` is appended, plus a DEFAULT
partition so inserts succeed before the partition lifecycle has made any range partition.
"""
from __future__ import annotations

from django.db import migrations


class CreatePartitionedModel(migrations.CreateModel):
    def __init__(self, *args, partition_column: str, **kwargs) -> None:
        self.partition_column = partition_column
        super().__init__(*args, **kwargs)

    def deconstruct(self):
        name, args, kwargs = super().deconstruct()
        kwargs["partition_column"] = self.partition_column
        return name, args, kwargs

    def database_forwards(self, app_label, schema_editor, from_state, to_state) -> None:
        model = to_state.apps.get_model(app_label, self.name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return
        table = schema_editor.quote_name(model._meta.db_table)
        sql, params = schema_editor.table_sql(model)
        column = schema_editor.quote_name(self.partition_column)
        schema_editor.execute(f"{sql} PARTITION BY RANGE ({column})", params or None)
        default = schema_editor.quote_name(f"{model._meta.db_table}_default")
        schema_editor.execute(f"CREATE TABLE {default} PARTITION OF {table} DEFAULT")
        schema_editor.deferred_sql.extend(schema_editor._model_indexes_sql(model))

    def describe(self) -> str:
        return f"Create model {self.name} partitioned by RANGE ({self.partition_column})"
