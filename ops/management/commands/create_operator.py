"""Create the first operator (an admin login) and a tenant's API user and token, on first run only.

Two accounts, two purposes: the operator (a superuser) signs in to the admin and holds no API
token; the API user (``api`` of tenant ``default``, neither staff nor superuser) is what clients
and the load test call with, so a token pasted into a script cannot promote models or read other
tenants' errors. Each secret is printed once, here, when its account is made; later runs say how
to get a token again (``manage.py drf_create_token api``). A checkout whose first run made only
the operator gets its API user on the next run.
"""
from __future__ import annotations

import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction
from rest_framework.authtoken.models import Token

from metadata.models import Tenant, TenantMembership


class Command(BaseCommand):
    help = "Create the first operator (admin login) and a tenant API user with a token; print each secret once."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--username", default="operator", help="The operator's admin login.")
        parser.add_argument("--api-user", default="api", help="The tenant's API user (no staff rights).")
        parser.add_argument("--tenant", default="default")

    def handle(self, *args, username: str, api_user: str, tenant: str, **options) -> None:
        User = get_user_model()
        if User.objects.filter(is_superuser=True).exists():
            self.stdout.write("operator account exists (its password was printed when it was created).")
        else:
            password = secrets.token_urlsafe(12)
            User.objects.create_superuser(username, email="", password=password)
            self.stdout.write(self.style.SUCCESS("First operator created (admin login, shown once, keep it):"))
            self.stdout.write(f"  username: {username}\n  password: {password}")
        if User.objects.filter(username=api_user).exists():
            self.stdout.write(f"API user '{api_user}' exists (its token: manage.py drf_create_token {api_user}).")
            return
        with transaction.atomic():
            user = User.objects.create_user(api_user, email="", password=None)  # token only, no password login
            team, _ = Tenant.objects.get_or_create(name=tenant)
            TenantMembership.objects.create(user=user, tenant=team)
            token = Token.objects.create(user=user)
        self.stdout.write(self.style.SUCCESS(f"API user created (tenant '{tenant}', not staff; shown once, keep it):"))
        self.stdout.write(f"  API token: {token.key}")
