"""Create the first operator (superuser), its tenant and API token, on first run only.

The password is printed once, here, and never stored in clear; later runs say the operator exists.
"""
from __future__ import annotations

import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction
from rest_framework.authtoken.models import Token

from metadata.models import Tenant, TenantMembership


class Command(BaseCommand):
    help = "Create the first operator account and print its credentials once."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--username", default="operator")
        parser.add_argument("--tenant", default="default")

    def handle(self, *args, username: str, tenant: str, **options) -> None:
        User = get_user_model()
        if User.objects.filter(is_superuser=True).exists():
            self.stdout.write("operator account exists (its password was printed when it was created).")
            return
        password = secrets.token_urlsafe(12)
        with transaction.atomic():
            user = User.objects.create_superuser(username, email="", password=password)
            team, _ = Tenant.objects.get_or_create(name=tenant)
            TenantMembership.objects.create(user=user, tenant=team)
            token = Token.objects.create(user=user)
        self.stdout.write(self.style.SUCCESS("First operator created (shown once, keep it):"))
        self.stdout.write(f"  username: {username}\n  password: {password}\n  API token: {token.key}")
