"""A new session, written only while its tenant is under its quota of live generations: one round trip.

The quota must stay exact under concurrency: two submissions of one tenant at ``limit - 1`` must
not both pass. So the tenant's row is locked (``FOR UPDATE``) before its live sessions are
counted, and the count, the check and the ``INSERT`` happen before the lock is released. Under
READ COMMITTED a statement sees what committed before it began, so the count must be a statement
that begins after the lock is held, never the locking statement itself.

Five round trips (``BEGIN``, the lock, the count, the ``INSERT``, ``COMMIT``) took about 45 % of
a generation request's time in the web process (bench/README.md, "Generation POST"); this is one:
the lock and a ``WITH`` statement that counts, checks and inserts, sent as one simple query
(psycopg's client-side binding, Django's default for PostgreSQL). PostgreSQL runs the statements
of one simple query as one transaction, each with its own snapshot, and commits at its end, so
the lock is held from before the count until the commit. Inside
a caller's transaction (a test, the admin's re-run) they are part of it and the lock is held until
it ends.

Nothing is written past the limit. Nothing is invalidated either: no cache can hold an entry for
the new id (a fresh UUIDv7, and a "no such row" is never cached), which is why this writes with
raw SQL and no ``post_save`` (its invalidation after commit read the row back and wrote two cache
regions: three Redis round trips and two database reads for nothing); ``seed_new_session_state``
puts the known state in Redis instead (``sessions.state``).
"""
from __future__ import annotations

from dataclasses import dataclass

from django.db import connections, transaction

from metadata.conf import conf
from metadata.models import LIVE_STATUSES, Session, Tenant
from metadata.replicas import lsn

__all__ = ["Admission", "insert_within_quota"]


@dataclass(frozen=True)
class Admission:
    """Whether the session was written, and the quota it was judged by."""

    created: bool
    live: int  # the tenant's sessions queued or running before this one
    limit: int  # 0: no limit
    own_limit: bool  # the tenant's own max_live_generations, not SPECOPS_TENANT_MAX_LIVE_GENERATIONS


@dataclass(frozen=True)
class _Statements:
    """The two statements' text for one connection, made once: compiling the ORM's count and
    each column's type cost about a tenth of a generation request's CPU when made per request."""

    lock: str
    insert: str
    live_params: tuple  # the count's parameters, the tenant's id as ``_TENANT``
    fields: tuple  # Session's concrete fields, in the INSERT's column order


_TENANT = object()  # the tenant's id in the cached count's parameters
_statements_by_alias: dict[str, _Statements] = {}


def _statements_for(connection) -> _Statements:
    made = _statements_by_alias.get(connection.alias)
    if made is not None:
        return made
    quote = connection.ops.quote_name
    tenant_table, tenant_pk = quote(Tenant._meta.db_table), quote(Tenant._meta.pk.column)
    fields = tuple(Session._meta.concrete_fields)
    columns = ", ".join(quote(field.column) for field in fields)
    # INSERT ... SELECT: an untyped parameter in a SELECT list is text, so each value is cast to its column.
    values = ", ".join(f"CAST(%s AS {field.db_type(connection)})" for field in fields)
    # The count the ORM would make (its plan reads the partial index of live sessions by tenant,
    # tests/inference/api/test_tenant_quotas.py), as a subquery; made for tenant 0, whose id is
    # then marked in the parameters.
    live_sql, live_params = Session.objects.filter(tenant_id=0, status__in=LIVE_STATUSES) \
        .values("pk").query.sql_with_params()
    if list(live_params).count(0) != 1:
        raise RuntimeError(f"the live count's parameters {live_params!r} do not show where the tenant's id goes")
    made = _Statements(
        lock=f"SELECT 1 FROM {tenant_table} WHERE {tenant_pk} = %s FOR UPDATE",
        insert=(
            f"WITH live AS (SELECT count(*) AS n FROM ({live_sql}) AS s), "
            f"quota AS (SELECT max_live_generations AS own, COALESCE(max_live_generations, %s) AS lim "
            f"FROM {tenant_table} WHERE {tenant_pk} = %s), "
            f"created AS (INSERT INTO {quote(Session._meta.db_table)} ({columns}) SELECT {values} FROM live, quota "
            f"WHERE quota.lim = 0 OR live.n < quota.lim RETURNING 1) "
            f"SELECT live.n, quota.own, quota.lim, (SELECT count(*) FROM created) FROM live, quota"
        ),
        live_params=tuple(_TENANT if p == 0 else p for p in live_params),
        fields=fields,
    )
    _statements_by_alias[connection.alias] = made
    return made


def insert_within_quota(session: Session, using: str = lsn.PRIMARY_ALIAS) -> Admission:
    """Write ``session`` (made in code, not saved) unless its tenant is at its limit.

    Raises ``Tenant.DoesNotExist`` if the tenant is gone. The written session is marked as saved.
    """
    connection = connections[using]
    statements = _statements_for(connection)
    lock, insert = statements.lock, statements.insert
    tenant = session.tenant_id
    lock_params = [tenant]
    insert_params = [*(tenant if p is _TENANT else p for p in statements.live_params),
                     conf.TENANT_MAX_LIVE_GENERATIONS, tenant,
                     *(field.get_db_prep_save(field.pre_save(session, add=True), connection)
                       for field in statements.fields)]
    if connection.settings_dict.get("OPTIONS", {}).get("server_side_binding"):
        # Server-side binding cannot send two statements at once: the same two, one at a time.
        with transaction.atomic(using=using), connection.cursor() as cursor:
            cursor.execute(lock, lock_params)
            cursor.execute(insert, insert_params)
            row = cursor.fetchone()
    else:
        with connection.cursor() as cursor:
            cursor.execute(f"{lock}; {insert}", [*lock_params, *insert_params])
            cursor.nextset()  # the first result is the lock's
            row = cursor.fetchone()
    if row is None:
        raise Tenant.DoesNotExist(f"tenant {session.tenant_id} does not exist")
    live, own, limit, created = row
    if created:
        # The statement begins with SELECT: the write marker did not see the INSERT, so the read
        # floor (X-SpecOps-LSN) is told here.
        lsn.note_write()
        session._state.adding, session._state.db = False, using
    return Admission(bool(created), live, limit, own is not None)
