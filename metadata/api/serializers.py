from __future__ import annotations

from rest_framework import serializers

from metadata.models import Candidate, Session, TokenRecord


class SessionSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="target.name", read_only=True)
    model_version = serializers.CharField(source="target.version", read_only=True)

    class Meta:
        model = Session
        fields = ("id", "status", "model", "model_version", "drafter", "queue", "prompt", "prompt_tokens",
                  "params", "token_count", "text", "finish_reason", "error", "stats", "attempts", "created_at",
                  "started_at", "finished_at", "updated_at")
        read_only_fields = fields


class TokenSerializer(serializers.ModelSerializer):
    kind = serializers.CharField(source="get_kind_display")

    class Meta:
        model = TokenRecord
        fields = ("position", "step", "token_id", "piece", "kind", "logprob")


class CandidateSerializer(serializers.ModelSerializer):
    class Meta:
        model = Candidate
        fields = ("step", "branch", "token_ids", "score", "accepted_len")
