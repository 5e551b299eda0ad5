"""Tenants and the API users who act for them: every API queryset is filtered by the tenant."""
from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone

from metadata.conf import conf


class Tenant(models.Model):
    """A customer of the platform: its users' sessions are its own, and its quotas bound its share.

    A quota left empty is the setting's default (``SPECOPS_TENANT_MAX_LIVE_GENERATIONS``,
    ``SPECOPS_TENANT_MAX_OPEN_STREAMS``); 0 is no limit.

    The tenant is the prefix cache's trust boundary: a cache hit (``cached_tokens``, a faster
    first token) tells the caller that someone in its boundary sent that prefix. Tenants an
    operator puts in one ``prefix_cache_group`` trust each other and share cached prefixes.
    """

    name = models.CharField(max_length=100, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    max_live_generations = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="generations queued or running at once (empty: SPECOPS_TENANT_MAX_LIVE_GENERATIONS; 0: no limit)")
    max_open_streams = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="session streams open at once (empty: SPECOPS_TENANT_MAX_OPEN_STREAMS; 0: no limit)")
    prefix_cache_group = models.SlugField(
        max_length=64, blank=True, default="", db_index=False,
        help_text="tenants with the same group share cached prompt prefixes, and so learn from cache hits "
                  "what the others sent; empty: this tenant's cached prefixes are its own")

    def prefix_cache_scope(self) -> str:
        """Who may adopt this tenant's cached prefixes: its group's name, or the tenant alone."""
        return prefix_cache_scope(self.pk, self.prefix_cache_group)

    def live_generation_limit(self) -> int:
        """Generations this tenant may have queued or running at once (0: no limit)."""
        if self.max_live_generations is not None:
            return self.max_live_generations
        return conf.TENANT_MAX_LIVE_GENERATIONS

    def open_stream_limit(self) -> int:
        """Session streams this tenant may hold open at once (0: no limit)."""
        if self.max_open_streams is not None:
            return self.max_open_streams
        return conf.TENANT_MAX_OPEN_STREAMS

    def __str__(self) -> str:
        return self.name


def prefix_cache_scope(tenant_id: int, group: str) -> str:
    """The prefix cache's scope of a tenant (``Tenant.prefix_cache_scope``) from its row's fields."""
    return f"group:{group}" if group else f"tenant:{tenant_id}"


class TenantMembership(models.Model):
    """Which tenant an API user acts for; every API queryset is filtered by it."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="membership")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="members")

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant}"
