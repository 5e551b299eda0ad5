"""A session's history: its generated tokens and the drafted candidates of each verification step.

Both tables are RANGE-partitioned on their session's creation time, so one session's rows live in
the partition of the same day as the session itself (one unit to archive and restore), and a
redelivered task's rows collide on the natural key (``ON CONFLICT DO NOTHING``) instead of being
written twice. Every primary key includes the partition column (PostgreSQL requires it).
"""
from __future__ import annotations

from django.db import models

from metadata.models.sessions import Session


class TokenKind(models.IntegerChoices):
    """What produced a token: the four outcomes of a verification step.

    TARGET (shown as "plain"): the target alone, in a step with no draft. ACCEPTED: a drafted token the target
    accepted. CORRECTION: the target's own token after it rejected a drafted one. BONUS: the
    target's extra token after every drafted token of a branch was accepted. (Rows written
    before CORRECTION existed carry BONUS for both of the last two.)
    """

    TARGET = 0, "plain"
    ACCEPTED = 1, "accepted draft"
    BONUS = 2, "bonus"
    CORRECTION = 3, "correction"


class TokenRecord(models.Model):
    """One generated token. Partitioned by ``session_created_at``."""

    pk = models.CompositePrimaryKey("session_id", "position", "session_created_at")
    # The primary key starts with session_id, so the FK needs no index of its own.
    session = models.ForeignKey(
        Session, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="+"
    )
    session_created_at = models.DateTimeField()
    position = models.PositiveIntegerField()
    step = models.PositiveIntegerField()
    token_id = models.IntegerField()
    piece = models.TextField()
    kind = models.SmallIntegerField(choices=TokenKind.choices)
    logprob = models.FloatField(null=True)

    class Meta:
        db_table = "metadata_token"

    def __str__(self) -> str:
        return f"{self.session_id}#{self.position}"


class Candidate(models.Model):
    """One drafted branch of one verification step, with its draft score (n-best candidates)."""

    pk = models.CompositePrimaryKey("session_id", "step", "branch", "session_created_at")
    # The primary key starts with session_id, so the FK needs no index of its own.
    session = models.ForeignKey(
        Session, on_delete=models.DO_NOTHING, db_constraint=False, db_index=False, related_name="+"
    )
    session_created_at = models.DateTimeField()
    step = models.PositiveIntegerField()
    branch = models.PositiveIntegerField()
    token_ids = models.JSONField()
    score = models.FloatField()
    accepted_len = models.PositiveIntegerField()

    class Meta:
        db_table = "metadata_candidate"
        indexes = [models.Index("session", models.F("score").desc(), "step", "branch", name="candidate_by_score")]

    def __str__(self) -> str:
        return f"{self.session_id} step {self.step} branch {self.branch}"
