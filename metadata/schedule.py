"""Shim for migration 0004, which imports ``register_periodic_tasks`` from here."""
from metadata.partitions.beat_jobs import register_periodic_tasks

__all__ = ["register_periodic_tasks"]
