"""Celery tasks of the project package (found by autodiscovery)."""
from specops.ops.gauges import sample_ops_metrics  # noqa: F401

__all__ = ["sample_ops_metrics"]
