"""The replica is a real streaming replica: it replays what the primary writes."""
from __future__ import annotations

import pytest
from django.conf import settings
from django.db import connections

from metadata.models import Tenant
from tests.helpers import wait_for

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


@pytest.fixture
def replica_alias() -> str:
    assert settings.DATABASE_REPLICAS, "make test configures one replica (DATABASE_REPLICA_URLS)"
    return settings.DATABASE_REPLICAS[0]


def scalar(alias: str, sql: str):
    with connections[alias].cursor() as cursor:
        cursor.execute(sql)
        return cursor.fetchone()[0]


def test_replica_is_a_standby_of_the_primary(replica_alias):
    assert scalar(replica_alias, "SELECT pg_is_in_recovery()") is True
    assert scalar("default", "SELECT pg_is_in_recovery()") is False
    assert scalar("default", "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'") >= 1
    assert connections[replica_alias].settings_dict["PORT"] != connections["default"].settings_dict["PORT"]


def test_row_written_on_primary_appears_on_replica(replica_alias):
    tenant = Tenant.objects.create(name="written-on-primary")
    replayed = wait_for(lambda: Tenant.objects.using(replica_alias).filter(pk=tenant.pk).first(),
                        timeout=20, what="the replica to replay the insert")
    assert replayed.name == "written-on-primary"


def test_replica_refuses_writes(replica_alias):
    from django.db import InternalError, ProgrammingError

    with pytest.raises((InternalError, ProgrammingError), match="read-only"):
        Tenant.objects.using(replica_alias).create(name="nope")
