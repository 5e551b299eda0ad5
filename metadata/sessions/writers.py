"""Batched, idempotent writes of token history and candidates from the workers.

Rows are buffered and written as multi-row ``INSERT ... ON CONFLICT DO NOTHING`` statements of at
most ``batch_size`` rows, one transaction per batch, so a redelivered task writes nothing twice and
a crash loses at most the unflushed tail (which the redelivery writes again).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from django.db import models, transaction

from metadata.conf import conf

M = TypeVar("M", bound=models.Model)


def insert_ignoring_conflicts(
    model: type[M], rows: Iterable[M], batch_size: int | None = None, using: str = "default"
) -> int:
    """Insert ``rows`` in committed batches; rows whose key already exists are skipped.

    Returns the number of rows handed to the database (PostgreSQL does not report the skipped
    conflicts through bulk_create).
    """
    writer = BufferedWriter(model, batch_size, using)
    for row in rows:
        writer.add(row)
    writer.flush()
    return writer.written


def _write_batch(model: type[M], batch: list[M], using: str) -> int:
    with transaction.atomic(using=using):
        model.objects.using(using).bulk_create(batch, ignore_conflicts=True)
    return len(batch)


class BufferedWriter:
    """Collect rows of one model and flush them in batches of at most ``batch_size``."""

    def __init__(self, model: type[M], batch_size: int | None = None, using: str = "default") -> None:
        self.model = model
        self.batch_size = batch_size or conf.TOKEN_BATCH_SIZE
        self.using = using
        self.pending: list[M] = []
        self.written = 0

    def add(self, row: M) -> None:
        self.pending.append(row)
        if len(self.pending) >= self.batch_size:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.written += _write_batch(self.model, self.pending, self.using)
            self.pending = []
