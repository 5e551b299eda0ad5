"""Session ids whose UUIDv7 time no datetime can hold (past year 9999) are unknown sessions: 404, never 500."""
from __future__ import annotations

import uuid

import pytest

from metadata.ids import created_at_of, is_uuid7
from metadata.session_keys import partition_key_filter

# the largest UUIDv7 time (year 10889), and the first millisecond of year 10000
FAR_IDS = ("ffffffff-ffff-7fff-bfff-ffffffffffff", "e677d21f-dc00-7000-8000-000000000000")
LATE_ID = "e6000000-0000-7000-8000-000000000000"  # year 9983: a datetime, in no partition


@pytest.mark.parametrize("session_id", FAR_IDS)
def test_a_time_past_datetimes_range_is_carried_by_no_session(session_id: str) -> None:
    assert is_uuid7(session_id)
    assert created_at_of(session_id) is None
    assert created_at_of(uuid.UUID(session_id)) is None
    assert partition_key_filter({"pk": session_id}) == {"pk": session_id}


@pytest.mark.django_db
@pytest.mark.parametrize("session_id", [*FAR_IDS, LATE_ID])
@pytest.mark.parametrize("method, suffix", [("get", ""), ("get", "tokens/"), ("get", "candidates/"),
                                            ("post", "cancel/"), ("get", "stream/")])
def test_the_api_answers_404_for_a_far_future_id(api_client, session_id: str, method: str, suffix: str) -> None:
    response = getattr(api_client, method)(f"/api/v1/sessions/{session_id}/{suffix}")
    assert response.status_code == 404, response.content
