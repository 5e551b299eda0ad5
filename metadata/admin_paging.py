"""Admin list pages over partitioned tables without ``COUNT(*)``.

Django's changelist asks its paginator for ``count`` on every page view: a ``COUNT(*)`` over the
whole sessions table (every partition) when nothing is filtered. ``EstimatedCountPaginator``
counts exactly only up to ``EXACT_COUNT_CAP`` rows (``SELECT count(*) FROM (... LIMIT cap + 1)``:
at most that many rows read, whatever the table holds); past it the count is the statistics
system's estimate: the partitions' ``pg_class.reltuples`` when the list is unfiltered, the
planner's row estimate (``EXPLAIN``, which starts from the same statistics) when it is filtered.
So the page number links are approximate past the cap, and the last page may be short or empty.
"""
from __future__ import annotations

import json

from django.core.paginator import Paginator
from django.db import connections
from django.db.models import QuerySet
from django.utils.functional import cached_property

EXACT_COUNT_CAP = 10_000

_PARTITIONS_RELTUPLES_SQL = """
SELECT coalesce(sum(greatest(c.reltuples, 0)), 0)::bigint
FROM pg_partition_tree(to_regclass(%s)) t
JOIN pg_class c ON c.oid = t.relid
WHERE t.isleaf
"""


def reltuples_estimate(queryset: QuerySet) -> int:
    """The rows the statistics system believes the model's table holds (all its partitions)."""
    with connections[queryset.db].cursor() as cursor:
        cursor.execute(_PARTITIONS_RELTUPLES_SQL, [queryset.model._meta.db_table])
        return int(cursor.fetchone()[0])


def planner_estimate(queryset: QuerySet) -> int:
    """The planner's row estimate for ``queryset`` (nothing runs but the plan)."""
    plan = json.loads(queryset.order_by().explain(format="json"))
    return int(plan[0]["Plan"]["Plan Rows"])


def is_unfiltered(queryset: QuerySet) -> bool:
    return not queryset.query.where


def estimated_count(queryset: QuerySet) -> int:
    """The exact count up to ``EXACT_COUNT_CAP``, else an estimate (never below the cap + 1)."""
    exact = queryset.order_by()[: EXACT_COUNT_CAP + 1].count()
    if exact <= EXACT_COUNT_CAP:
        return exact
    estimate = reltuples_estimate(queryset) if is_unfiltered(queryset) else planner_estimate(queryset)
    return max(estimate, EXACT_COUNT_CAP + 1)


class EstimatedCountPaginator(Paginator):
    """A paginator whose ``count`` is ``estimated_count`` (the module's docstring says why)."""

    @cached_property
    def count(self) -> int:
        return estimated_count(self.object_list)
