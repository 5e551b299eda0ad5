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


class BatchWriter:
    """Rows of several models (tokens and candidates of every session in a batch), flushed together.

    One transaction per flush; inside it, one multi-row ``INSERT ... ON CONFLICT DO NOTHING`` per
    ``batch_size`` rows of each model. The batching worker adds each step's rows of all its
    sessions and, when a model has ``batch_size`` rows pending or on its own schedule, hands them
    (``take``) to its writer thread, whose own BatchWriter flushes them; a flush that fails keeps
    its rows for the next one.
    """

    def __init__(self, models_: Iterable[type[models.Model]], batch_size: int | None = None,
                 using: str = "default") -> None:
        self.batch_size = batch_size or conf.TOKEN_BATCH_SIZE
        self.using = using
        self.pending: dict[type[models.Model], list[models.Model]] = {model: [] for model in models_}
        self.written = 0
        self.flushes = 0

    def add(self, row: models.Model) -> None:
        self.pending[type(row)].append(row)

    def take(self) -> dict[type[models.Model], list[models.Model]]:
        """Hand over every pending row (to be written by another writer); this one starts empty."""
        taken = self.pending
        self.pending = {model: [] for model in taken}
        return taken

    def extend(self, rows: dict[type[models.Model], list[models.Model]]) -> None:
        """Add rows another writer ``take``-s, after the ones pending here."""
        for model, batch in rows.items():
            self.pending[model].extend(batch)

    @property
    def full(self) -> bool:
        return any(len(rows) >= self.batch_size for rows in self.pending.values())

    def __len__(self) -> int:
        return sum(len(rows) for rows in self.pending.values())

    def flush(self) -> int:
        """Write everything pending in one transaction; return the rows written."""
        if not len(self):
            return 0
        written = 0
        with transaction.atomic(using=self.using):
            for model, rows in self.pending.items():
                for start in range(0, len(rows), self.batch_size):
                    batch = rows[start:start + self.batch_size]
                    model.objects.using(self.using).bulk_create(batch, ignore_conflicts=True)
                    written += len(batch)
        for rows in self.pending.values():
            rows.clear()
        self.written += written
        self.flushes += 1
        return written
