"""Which statements scan big tables sequentially: EXPLAIN of the normalised statement, generic plan.

PostgreSQL 16 has ``EXPLAIN (GENERIC_PLAN)``; on 15 the statement is prepared as it is (its ``$n``
become parameters of unknown type, resolved from context) and explained with
``plan_cache_mode = force_generic_plan``, so the NULLs passed as parameters shape nothing: the plan
is the one any values would get. Only plain SELECTs are explained (EXPLAIN without ANALYZE runs
nothing, but a data-modifying statement is not worth the doubt), under a short statement timeout,
in a transaction that also deallocates the prepared statement (safe through PgBouncer). A
relation is big from ``SPECOPS_INSIGHTS_BIG_TABLE_ROWS`` rows (planner estimate, or live tuples).
"""
from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from django.db import DatabaseError, connections, transaction

from metadata.conf import conf
from metadata.insights.statements import parameter_count

EXPLAIN_TIMEOUT_MS = 2000
SELECT_ONLY = re.compile(r"^\s*(\(\s*)*select\b", re.IGNORECASE)
WRITES = re.compile(r"\b(insert|update|delete|merge|into|for\s+(update|share|no\s+key|key))\b", re.IGNORECASE)

SIZES_SQL = """
SELECT c.relname, greatest(c.reltuples, coalesce(s.n_live_tup, 0), 0)::bigint, p.relname
FROM pg_class c
LEFT JOIN pg_stat_all_tables s ON s.relid = c.oid
LEFT JOIN pg_inherits i ON i.inhrelid = c.oid
LEFT JOIN pg_class p ON p.oid = i.inhparent
WHERE c.relname = ANY(%s)
"""


@dataclass(frozen=True)
class SequentialScan:
    relation: str
    parent: str | None  # the partitioned table, when the relation is one of its partitions
    rows: int


@dataclass(frozen=True)
class PlanCheck:
    """What EXPLAIN said: the big relations scanned sequentially, or why it was not asked."""

    scans: list[SequentialScan] = field(default_factory=list)
    skipped: str = ""

    @property
    def flagged(self) -> bool:
        return bool(self.scans)


def explainable(query: str) -> str:
    """Why ``query`` is not explained, or "" when it may be."""
    if not SELECT_ONLY.match(query):
        return "not a SELECT"
    if WRITES.search(query):
        return "may write or lock rows"
    if "..." in query:
        return "text truncated or folded"
    return ""


def _scanned(plan: dict) -> Iterator[str]:
    if plan.get("Node Type") == "Seq Scan" and plan.get("Relation Name"):
        yield plan["Relation Name"]
    for child in plan.get("Plans", ()):
        yield from _scanned(child)


def generic_plan(query: str, using: str) -> dict:
    """The generic plan of ``query`` (with ``$n`` parameters) as EXPLAIN's JSON root node."""
    name = f"specops_explain_{uuid.uuid4().hex[:12]}"
    arguments = ", ".join(["NULL"] * parameter_count(query))
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        cursor.execute(f"SET LOCAL statement_timeout = {EXPLAIN_TIMEOUT_MS}")
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute(f"PREPARE {name} AS {query}")
        try:
            with transaction.atomic(using=using):  # a savepoint: DEALLOCATE still runs after a failure
                cursor.execute(f"EXPLAIN (FORMAT JSON) EXECUTE {name}" + (f"({arguments})" if arguments else ""))
                document = cursor.fetchone()[0]
        finally:
            cursor.execute(f"DEALLOCATE {name}")
    if isinstance(document, str):
        import json

        document = json.loads(document)
    return document[0]["Plan"]


def sequential_scans(query: str, using: str = "default", big_rows: int | None = None) -> PlanCheck:
    """Explain ``query`` on ``using`` and name the big relations its generic plan scans sequentially."""
    reason = explainable(query)
    if reason:
        return PlanCheck(skipped=reason)
    big_rows = int(conf.INSIGHTS_BIG_TABLE_ROWS if big_rows is None else big_rows)
    try:
        relations = sorted(set(_scanned(generic_plan(query, using))))
        if not relations:
            return PlanCheck()
        with connections[using].cursor() as cursor:
            cursor.execute(SIZES_SQL, [relations])
            sizes = cursor.fetchall()
    except DatabaseError as exc:
        return PlanCheck(skipped="EXPLAIN failed: " + " ".join(str(exc).split())[:160])
    scans = [SequentialScan(name, parent, rows) for name, rows, parent in sizes if rows >= big_rows]
    return PlanCheck(scans=sorted(scans, key=lambda s: -s.rows))
