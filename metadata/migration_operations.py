"""Shim for migration 0001, which imports ``CreatePartitionedModel`` from here."""
from metadata.partitions.migration_operations import CreatePartitionedModel

__all__ = ["CreatePartitionedModel"]
