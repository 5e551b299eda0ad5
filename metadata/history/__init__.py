"""A session's token and candidate history as the store keeps it: its rows, written in batches.

``token_records`` makes the token rows of one step (``pg_text``: text as PostgreSQL can store
it); ``BatchWriter`` (several models, one transaction a flush), ``BufferedWriter`` and
``insert_ignoring_conflicts`` write them in multi-row ``INSERT ... ON CONFLICT DO NOTHING``
statements, so a redelivered run writes nothing twice. Import once Django is set up.
"""
from __future__ import annotations

from metadata.history.rows import NUL_IN_TEXT, pg_text, token_records
from metadata.history.writers import BatchWriter, BufferedWriter, insert_ignoring_conflicts

__all__ = ["NUL_IN_TEXT", "BatchWriter", "BufferedWriter", "insert_ignoring_conflicts", "pg_text", "token_records"]
