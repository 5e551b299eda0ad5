"""A session's place in its device queue: a tenant with fewer sessions in flight is ahead of a busy one."""
from __future__ import annotations

from urllib.parse import urlsplit

from celery import current_app

# Celery's priorities are 0-9 on every transport, but the Redis transport takes the lowest number
# first and RabbitMQ the highest (specops/celery.py declares the levels on each broker).
PRIORITY_LEVELS = 10


def load_rank(live: int) -> int:
    """0 for a tenant with nothing in flight, then one rank per doubling of its load, 9 at most
    (1: 1, 2: 2-3, 3: 4-7, ... 9: 256 or more), so a quiet tenant is ahead of a busy one."""
    return min(PRIORITY_LEVELS - 1, live.bit_length())


def broker_priority(live: int, broker_url: str | None = None) -> int:
    """The Celery priority of a message from a tenant with ``live`` sessions already in flight."""
    url = broker_url if broker_url is not None else str(current_app.conf.broker_url or "")
    rank = load_rank(live)
    if urlsplit(url).scheme in ("redis", "rediss", "sentinel", "redis+socket"):
        return rank  # kombu's Redis transport reads priority 0 first
    return PRIORITY_LEVELS - 1 - rank  # AMQP: the highest priority first
