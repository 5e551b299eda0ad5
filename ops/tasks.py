"""Celery tasks of the ops app (found by autodiscovery)."""
from ops.gauges import sample_ops_metrics  # noqa: F401

__all__ = ["sample_ops_metrics"]
