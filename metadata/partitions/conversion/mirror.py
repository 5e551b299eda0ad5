"""The mirror trigger (phase ``armed``): every write to the source is repeated in the shadow.

A row trigger on the source mirrors INSERT/UPDATE/DELETE (and a statement trigger TRUNCATE) into
the shadow as an upsert or a delete, in the writer's own transaction: a source change and its
mirror commit or roll back together, so every snapshot sees both or neither. A key or
partition-key change is a delete of the old key and an upsert of the new one.

Arming: ``CREATE TRIGGER`` takes SHARE ROW EXCLUSIVE on the source, so it waits for every
transaction that has written to it and blocks new writes until it commits; a write is either
committed before the trigger exists (then the copy, whose batches take snapshots after, sees it)
or made after (then the trigger mirrors it). A transaction that only read the source before and
writes after takes a stronger lock for the write and reloads the table's triggers then.
"""
from __future__ import annotations

from metadata.partitions.conversion.context import ConversionContext
from metadata.partitions.conversion.source import SourceShape
from metadata.partitions.locks import quote, with_lock_retries


def arm(ctx: ConversionContext, shape: SourceShape) -> None:
    """The mirror trigger, created under lock_timeout (it waits for the source's writers)."""
    function_sql = _mirror_function(ctx, shape)

    def create() -> None:
        ctx.execute(function_sql)
        ctx.execute(f"CREATE OR REPLACE FUNCTION {quote(ctx.function + '_t')}() RETURNS trigger "
                    f"LANGUAGE plpgsql AS $$ BEGIN TRUNCATE {quote(ctx.shadow)}; RETURN NULL; END $$")
        ctx.execute(f"DROP TRIGGER IF EXISTS {quote(ctx.trigger)} ON {quote(ctx.table)}")
        ctx.execute(f"DROP TRIGGER IF EXISTS {quote(ctx.trigger + '_t')} ON {quote(ctx.table)}")
        ctx.execute(f"CREATE TRIGGER {quote(ctx.trigger)} AFTER INSERT OR UPDATE OR DELETE ON "
                    f"{quote(ctx.table)} FOR EACH ROW EXECUTE FUNCTION {quote(ctx.function)}()")
        ctx.execute(f"CREATE TRIGGER {quote(ctx.trigger + '_t')} AFTER TRUNCATE ON {quote(ctx.table)} "
                    f"FOR EACH STATEMENT EXECUTE FUNCTION {quote(ctx.function + '_t')}()")
        ctx.set_state(phase="armed")

    with_lock_retries(create, f"arm the mirror trigger on {ctx.table}", ctx.using)
    ctx.progress(f"{ctx.table}: writes now mirrored into {ctx.shadow}")
    ctx.crash_at("armed")


def disarm(ctx: ConversionContext) -> None:
    """Drop both triggers and their functions (inside the swap, under its ACCESS EXCLUSIVE lock)."""
    ctx.execute(f"DROP TRIGGER IF EXISTS {quote(ctx.trigger)} ON {quote(ctx.table)}")
    ctx.execute(f"DROP TRIGGER IF EXISTS {quote(ctx.trigger + '_t')} ON {quote(ctx.table)}")
    ctx.execute(f"DROP FUNCTION IF EXISTS {quote(ctx.function)}()")
    ctx.execute(f"DROP FUNCTION IF EXISTS {quote(ctx.function + '_t')}()")


def _mirror_function(ctx: ConversionContext, shape: SourceShape) -> str:
    key = shape.pk + ([] if ctx.column in shape.pk else [ctx.column])
    cols = ", ".join(quote(c) for c in shape.columns)
    new = ", ".join(f"NEW.{quote(c)}" for c in shape.columns)
    match_old = " AND ".join(f"{quote(c)} = OLD.{quote(c)}" for c in key)
    changed = " OR ".join(f"OLD.{quote(c)} IS DISTINCT FROM NEW.{quote(c)}" for c in key)
    rest = [c for c in shape.columns if c not in key]
    upsert = (f"DO UPDATE SET {', '.join(f'{quote(c)} = EXCLUDED.{quote(c)}' for c in rest)}" if rest
              else "DO NOTHING")
    shadow = quote(ctx.shadow)
    return f"""CREATE OR REPLACE FUNCTION {quote(ctx.function)}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' OR (TG_OP = 'UPDATE' AND ({changed})) THEN
        DELETE FROM {shadow} WHERE {match_old};
    END IF;
    IF TG_OP = 'DELETE' THEN
        RETURN NULL;
    END IF;
    INSERT INTO {shadow} ({cols}) VALUES ({new})
        ON CONFLICT ({', '.join(quote(c) for c in key)}) {upsert};
    RETURN NULL;
END $$"""
