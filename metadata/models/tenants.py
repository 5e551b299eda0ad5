"""Tenants and the API users who act for them: every API queryset is filtered by the tenant."""
from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class Tenant(models.Model):
    name = models.CharField(max_length=100, unique=True)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return self.name


class TenantMembership(models.Model):
    """Which tenant an API user acts for; every API queryset is filtered by it."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="membership")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="members")

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant}"
