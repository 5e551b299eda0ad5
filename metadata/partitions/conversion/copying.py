"""The copy (phases ``copying``, ``copied``): existing rows into the shadow in committed keyset batches.

Why the copy never loses or leaves stale a row while writers go on (the mirror trigger, armed
before, repeats every write in the writer's own transaction; ``mirror``):

* ``copy_until``, the largest key, is read after arming, so every row with a larger key, and
  every row that is not visible then, was written with the trigger in place: the copy never has
  to chase writers. Rows are copied up to it over the primary key; ``last_key`` and
  ``rows_copied`` are committed with each batch, so a rerun goes on from the last one.
* A batch is a key range ``(last_key, end]``, ``end`` being the key ``n`` rows on (read first,
  unlocked, so the cursor never depends on what the lock finds), then ``SELECT ... WHERE pk in
  that range FOR SHARE`` feeding ``INSERT ... ON CONFLICT DO NOTHING``. FOR SHARE makes a
  concurrent UPDATE or DELETE of a row in the batch wait until the batch commits; its trigger
  then upserts the newer version over the copy, or deletes it. A writer that locked a row first
  makes the batch wait; READ COMMITTED then re-reads the row's newest version (or skips it if
  deleted) and the batch copies that version, which the writer's trigger has already put in the
  shadow, so DO NOTHING keeps the same row.
* A row inserted behind the cursor (random UUIDs) or ahead of it arrives through the trigger; the
  copy reaching it later does nothing (the conflict). A row deleted before the copy reaches it is
  gone from both. The shadow's key (source PK + column) is wider than the source's, so its
  conflicts are exactly the source's.
* Deadlocks: a batch waits on a writer's row lock and the writer then on a row the batch locked.
  Batches run under the maintenance ``lock_timeout`` (500 ms by default), shorter than
  ``deadlock_timeout`` (1 s by default; keep it so): the batch gives up first and is retried, so
  the deadlock detector never picks the application's transaction.
* A row whose primary key changes while the batch waits for it leaves or enters the range; its
  new version came through the trigger either way, and the next range starts at ``end`` whatever
  the batch locked (a cursor taken from the locked rows could jump past unread rows). The copy
  ends with the range that ends at ``copy_until``.
"""
from __future__ import annotations

import json
import time

from metadata.partitions.conversion.context import ConversionContext
from metadata.partitions.conversion.source import SourceShape
from metadata.partitions.conversion.state import ConversionState
from metadata.partitions.locks import quote, with_lock_retries


def copy_rows(ctx: ConversionContext, shape: SourceShape, state: ConversionState) -> None:
    """Copy the rows up to ``copy_until`` in committed keyset batches (see the module docstring)."""
    pk = ", ".join(quote(c) for c in shape.pk)
    if state.phase == "armed":  # read after the trigger is in place, never before
        bound = ctx.fetch(f"SELECT ARRAY[{_key_text(shape)}] FROM {quote(ctx.table)} "
                          f"ORDER BY {pk} DESC LIMIT 1")
        state.copy_until = list(bound[0][0]) if bound else None
        ctx.set_state(phase="copying" if bound else "copied", copy_until=json.dumps(state.copy_until))
        if not bound:
            return
    cols = ", ".join(quote(c) for c in shape.columns)
    last, copied = state.last_key, state.rows_copied
    reported = time.perf_counter()
    ctx.progress(f"{ctx.table}: copying into {ctx.shadow} from "
                 f"{'the start' if last is None else 'key ' + '/'.join(last)} ({copied} row(s) so far)")
    while True:
        def one_batch() -> tuple[int, list[str]]:
            end = _batch_end(ctx, shape, pk, last, state.copy_until)
            where, params = _key_range(shape, pk, last, end)
            scanned = ctx.fetch(
                f"WITH batch AS MATERIALIZED (SELECT {cols} FROM {quote(ctx.table)} WHERE {where} FOR SHARE), "
                f"copied AS (INSERT INTO {quote(ctx.shadow)} ({cols}) SELECT {cols} FROM batch "
                f"ON CONFLICT DO NOTHING RETURNING 1) SELECT (SELECT count(*) FROM batch)", params)[0][0]
            ctx.set_state(phase="copying", last_key=json.dumps(end), rows_copied=copied + scanned)
            return scanned, end

        scanned, last = with_lock_retries(one_batch, f"copy a batch of {ctx.table}", ctx.using)
        copied += scanned
        ctx.crash_at("batch")
        if last == list(state.copy_until):
            break
        ctx.pacer.pause()
        if time.perf_counter() - reported >= 2.0:
            ctx.progress(f"{ctx.table}: copied {copied} row(s), up to key {'/'.join(last)}")
            reported = time.perf_counter()
    ctx.set_state(phase="copied")
    ctx.progress(f"{ctx.table}: copied {copied} row(s) into {ctx.shadow}")
    ctx.crash_at("copied")


def _batch_end(ctx: ConversionContext, shape: SourceShape, pk: str, last: list[str] | None,
               until: list[str]) -> list[str]:
    """The key ``batch_rows`` rows past ``last`` (or ``until``): a batch is a key RANGE fixed before
    it is locked, so a row whose key changes under the lock cannot move the cursor past others."""
    where, params = _key_range(shape, pk, last, until)
    found = ctx.fetch(f"SELECT ARRAY[{_key_text(shape)}] FROM {quote(ctx.table)} WHERE {where} "
                      f"ORDER BY {pk} OFFSET {int(ctx.batch_rows) - 1} LIMIT 1", params)
    return list(found[0][0]) if found else list(until)


def _key_range(shape: SourceShape, pk: str, after: list[str] | None, upto: list[str]) -> tuple[str, list]:
    where, params = f"({pk}) <= ({_key_params(shape)})", list(upto)
    if after is not None:
        where, params = f"({pk}) > ({_key_params(shape)}) AND {where}", list(after) + params
    return where, params


def _key_text(shape: SourceShape) -> str:
    return ", ".join(f"{quote(c)}::text" for c in shape.pk)


def _key_params(shape: SourceShape) -> str:
    return ", ".join(f"%s::{shape.types[c]}" for c in shape.pk)
