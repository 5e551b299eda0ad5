"""The admin's partitions page and archival job list (metadata.admin)."""
from __future__ import annotations

import datetime as dt

from django.urls import reverse

from metadata.partitions import PartitionPolicy, PartitionRotation
from tests.metadata.partition_helpers import day, insert_tokens


def test_partitions_page_shows_bounds_rows_and_the_default_partition(partitioned, admin_client) -> None:
    PartitionRotation(PartitionPolicy(retention=dt.timedelta(days=3)), progress=lambda _: None).run(day(0))
    insert_tokens(day(0, hour=1), 30)
    insert_tokens(day(30), 4)  # stranded in DEFAULT
    response = admin_client.get(reverse("admin:metadata_partitions"))
    assert response.status_code == 200
    page = response.content.decode()
    assert f"metadata_token_p{day(0):%Y%m%d}" in page and "2030-01-01 00:00" in page
    assert "DEFAULT partition <code>metadata_token_default</code>:\n      4 rows" in page
    assert "the next rotation drains them" in page


def test_archival_jobs_are_listed_read_only(partitioned, admin_client) -> None:
    policy = PartitionPolicy(retention=dt.timedelta(days=1))
    PartitionRotation(policy, progress=lambda _: None).run(day(0))
    PartitionRotation(policy, progress=lambda _: None).run(day(3))
    listing = admin_client.get(reverse("admin:metadata_partitionarchivaljob_changelist"))
    assert listing.status_code == 200
    page = listing.content.decode()
    assert f"metadata_token_p{day(0):%Y%m%d}" in page and reverse("admin:metadata_partitions") in page
    assert admin_client.get(reverse("admin:metadata_partitionarchivaljob_add")).status_code == 403


def test_the_admin_index_links_the_partitions_page(admin_client) -> None:
    response = admin_client.get(reverse("admin:index"))
    assert response.status_code == 200
    assert f'href="{reverse("admin:metadata_partitions")}"' in response.content.decode()
