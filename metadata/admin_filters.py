"""Admin list filters whose choices come from a fixed list, not from the table.

Django's filter for a plain CharField (``AllValuesFieldListFilter``) runs ``SELECT DISTINCT`` over
the whole table on every page view to find its choices: on the partitioned sessions table that
reads every partition. ``choices_filter`` builds a filter whose choices come from a callable the
app knows (the drafter registry, the model versions' queues), so the page reads no more than it
lists.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from django.contrib import admin


class FixedChoicesFilter(admin.SimpleListFilter):
    """Filter ``field`` on one of ``choices()`` (set by ``choices_filter``)."""

    field = ""
    choices_of: Callable[[], Iterable[str]] = staticmethod(lambda: ())

    def lookups(self, request, model_admin) -> list[tuple[str, str]]:
        return [(value, value) for value in self.choices_of()]

    def queryset(self, request, queryset):
        value = self.value()
        return queryset.filter(**{self.field: value}) if value else queryset


def choices_filter(field: str, choices: Callable[[], Iterable[str]], title: str | None = None) -> type:
    """A ``FixedChoicesFilter`` on ``field`` with the choices ``choices()`` gives (read per page view)."""
    return type(f"{field.title()}ChoicesFilter", (FixedChoicesFilter,), {
        "field": field, "parameter_name": field, "title": title or field, "choices_of": staticmethod(choices)})
