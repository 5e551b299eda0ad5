"""Database routing. Placeholder until the lag-aware replica router lands (issue 5):
everything goes to the primary; replicas are only used when a caller names them."""
from __future__ import annotations


class ReplicaRouter:
    def db_for_read(self, model, **hints) -> str:
        return "default"

    def db_for_write(self, model, **hints) -> str:
        return "default"

    def allow_relation(self, obj1, obj2, **hints) -> bool:
        return True

    def allow_migrate(self, db: str, app_label: str, **hints) -> bool:
        return db == "default"
