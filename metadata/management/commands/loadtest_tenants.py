"""Create or remove the tenants, users and tokens of one load-test run (``deploy/loadtest/run.sh``).

One tenant and one API user with a token per simulated client, so a load test measures the
platform and not the per-token and per-tenant throttles (every client sharing one token is
refused at the throttle's rate). ``create`` writes the tokens, one a line, to ``--out`` (mode
0600) and nothing else; ``remove`` deletes the run's users (their tokens and memberships go with
them). The tenants are ``loadtest-<n>``, reused by every run: one that has sessions keeps them (a
session's tenant cannot be deleted, and its history stays readable in the admin), one without any
is deleted. The users are not staff and have no password: a token is their only credential.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from rest_framework.authtoken.models import Token

from metadata.models import Session, Tenant, TenantMembership

PREFIX = "loadtest-"
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,60}$")
MAX_CLIENTS = 10_000


def tenant_name(number: int) -> str:
    return f"{PREFIX}{number}"


def user_prefix(run: str) -> str:
    return f"{PREFIX}{run}-"


class Command(BaseCommand):
    help = "Create (or remove) one tenant, API user and token per simulated client of a load-test run."

    def add_arguments(self, parser) -> None:
        parser.add_argument("action", choices=("create", "remove"))
        parser.add_argument("--run", required=True, help="The run's id (letters, digits, . _ -): names its users.")
        parser.add_argument("--count", type=int, default=0, help="create: clients, one tenant and token each.")
        parser.add_argument("--out", type=Path, help="create: file the tokens are written to, one a line.")

    def handle(self, *args, action: str, run: str, count: int, out: Path | None, **options) -> None:
        if not RUN_ID.fullmatch(run):
            raise CommandError(f"--run must be letters, digits, '.', '_' or '-' (at most 61), got {run!r}")
        if action == "create":
            if not 1 <= count <= MAX_CLIENTS:
                raise CommandError(f"--count must be from 1 to {MAX_CLIENTS}, got {count}")
            if out is None:
                raise CommandError("create needs --out (the tokens file)")
            tokens = self.create(run, count)
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write("".join(f"{key}\n" for key in tokens))
            self.stdout.write(f"load test {run}: {count} tenants ({tenant_name(1)}..{tenant_name(count)}), "
                              f"one API user and token each; tokens in {out}")
        else:
            users, tenants = self.remove(run)
            self.stdout.write(f"load test {run}: removed {users} users and their tokens, {tenants} tenants "
                              "without sessions")

    @transaction.atomic
    def create(self, run: str, count: int) -> list[str]:
        User = get_user_model()
        if User.objects.filter(username__startswith=user_prefix(run)).exists():
            raise CommandError(f"load test {run} has users already (remove them first: loadtest_tenants remove "
                               f"--run {run})")
        tokens = []
        for number in range(1, count + 1):
            tenant, _ = Tenant.objects.get_or_create(name=tenant_name(number))
            user = User.objects.create_user(f"{user_prefix(run)}{number}", password=None)
            TenantMembership.objects.create(user=user, tenant=tenant)
            tokens.append(Token.objects.create(user=user).key)
        return tokens

    @transaction.atomic
    def remove(self, run: str) -> tuple[int, int]:
        users = get_user_model().objects.filter(username__startswith=user_prefix(run))
        tenant_ids = set(TenantMembership.objects.filter(user__in=users).values_list("tenant_id", flat=True))
        removed = users.count()
        users.delete()  # memberships and tokens cascade
        unused = Tenant.objects.filter(pk__in=tenant_ids, name__startswith=PREFIX, members__isnull=True) \
            .exclude(pk__in=Session.objects.filter(tenant_id__in=tenant_ids).values("tenant_id"))
        return removed, unused.delete()[1].get("metadata.Tenant", 0)
