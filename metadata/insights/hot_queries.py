"""Hot queries: the statements that cost most over a window, per database, from the snapshots.

Rows of ``StatementSnapshot`` in the window are summed per database and normalised text (one
statement sent with lists of different lengths is one line), ranked by total time, mean, max,
calls or rows. ``share`` is the statement's part of all statement time of its database in the
window. The sequential-scan check (``metadata.insights.explain``) runs on request, for the lines
shown, with the text pg_stat_statements keeps for one of the statement's query ids.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from django.db import connections

from metadata.insights.explain import PlanCheck, sequential_scans
from metadata.insights.window import Window
from metadata.models import StatementBaseline, StatementSnapshot

ORDERS = {"total": "total_ms", "mean": "mean_ms", "max": "max_ms", "calls": "calls", "rows": "rows"}
PRIMARY = "default"

_SQL = """
WITH per_statement AS (
    SELECT database, query, max(family) AS family,
           coalesce(string_agg(DISTINCT nullif(source, ''), ', '), '') AS sources,
           sum(calls)::bigint AS calls, sum(total_time_ms) AS total_ms, max(max_time_ms) AS max_ms,
           sum(rows)::bigint AS rows, sum(shared_blks_read)::bigint AS blks_read,
           sum(shared_blks_written)::bigint AS blks_written, min(queryid) AS queryid
    FROM {table}
    WHERE taken_at > %s AND taken_at <= %s {database_filter}
    GROUP BY database, query
), ranked AS (
    SELECT *, total_ms / nullif(calls, 0) AS mean_ms,
           total_ms / nullif(sum(total_ms) OVER (PARTITION BY database), 0) AS share,
           sum(total_ms) OVER (PARTITION BY database) AS database_ms,
           sum(calls) OVER (PARTITION BY database) AS database_calls
    FROM per_statement
)
SELECT * FROM (
    SELECT *, row_number() OVER (PARTITION BY database ORDER BY {order} DESC NULLS LAST, query) AS rank
    FROM ranked
) r WHERE rank <= %s ORDER BY database, rank
"""


@dataclass(frozen=True)
class HotQuery:
    database: str
    query: str
    family: str
    source: str  # "view=…", "task=…" (several, comma-separated), or "" when untagged
    calls: int
    total_ms: float
    mean_ms: float
    max_ms: float
    rows: int
    shared_blks_read: int
    shared_blks_written: int
    share: float  # of all statement time of this database in the window
    queryid: int
    plan: PlanCheck | None = None


@dataclass
class DatabaseStatements:
    database: str
    total_ms: float = 0.0
    calls: int = 0
    statements: list[HotQuery] = field(default_factory=list)


def hot_queries(window: Window, order: str = "total", limit: int = 20,
                databases: list[str] | None = None) -> dict[str, DatabaseStatements]:
    """The top ``limit`` statements of each database in ``window``, by ``order`` (see ``ORDERS``)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    params: list = [window.start, window.end]
    database_filter = ""
    if databases:
        database_filter, params = "AND database = ANY(%s)", params + [list(databases)]
    sql = _SQL.format(table=StatementSnapshot._meta.db_table, database_filter=database_filter, order=ORDERS[order])
    with connections[PRIMARY].cursor() as cursor:
        cursor.execute(sql, params + [limit])
        columns = [c.name for c in cursor.description]
        rows = [dict(zip(columns, row)) for row in cursor.fetchall()]
    result: dict[str, DatabaseStatements] = {}
    for row in rows:
        entry = result.setdefault(row["database"], DatabaseStatements(row["database"], float(row["database_ms"] or 0),
                                                                      int(row["database_calls"] or 0)))
        entry.statements.append(HotQuery(
            database=row["database"], query=row["query"], family=row["family"], source=row["sources"],
            calls=row["calls"], total_ms=float(row["total_ms"]), mean_ms=float(row["mean_ms"] or 0),
            max_ms=float(row["max_ms"]), rows=row["rows"], shared_blks_read=row["blks_read"],
            shared_blks_written=row["blks_written"], share=float(row["share"] or 0), queryid=row["queryid"]))
    return result


def with_plans(statements: list[HotQuery], big_rows: int | None = None) -> list[HotQuery]:
    """The same statements, each with its sequential-scan check (EXPLAIN on its own database)."""
    texts = dict(StatementBaseline.objects.using(PRIMARY)
                 .filter(queryid__in=[s.queryid for s in statements])
                 .values_list("queryid", "query"))
    checked = []
    for statement in statements:
        text = texts.get(statement.queryid)
        plan = sequential_scans(text, statement.database, big_rows) if text else PlanCheck(
            skipped="text no longer in pg_stat_statements")
        checked.append(replace(statement, plan=plan))
    return checked
