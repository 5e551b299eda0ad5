from __future__ import annotations

from typing import Any

from rest_framework import serializers

from metadata.models import Candidate, Session, TokenRecord

# What a tenant is told of a session's error: a stable message per code. The stored error (an
# exception's text: "Error 111 connecting to 127.0.0.1:6379", a worker's host name) is for staff.
ERROR_MESSAGES = {
    "worker_lost": "the generation's worker was lost; it is retried up to the attempt limit.",
    "worker_error": "generation failed",
}


def error_code(error: str) -> str | None:
    """The stable code of a stored session error (None when there is none)."""
    if not error:
        return None
    return "worker_lost" if "worker lost" in error or "was lost" in error else "worker_error"


def public_error(error: str, *, staff: bool) -> dict[str, Any]:
    """``{"error", "error_code"}`` as the caller may see them: the stored detail for staff only."""
    code = error_code(error)
    if code is None:
        return {"error": "", "error_code": None}
    return {"error": error if staff else ERROR_MESSAGES[code], "error_code": code}


def is_staff(request: Any) -> bool:
    return bool(getattr(getattr(request, "user", None), "is_staff", False))


class SessionSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="target.name", read_only=True)
    model_version = serializers.CharField(source="target.version", read_only=True)
    error_code = serializers.SerializerMethodField(help_text="worker_lost or worker_error; null without an error.")

    class Meta:
        model = Session
        fields = ("id", "status", "model", "model_version", "drafter", "queue", "prompt", "prompt_tokens",
                  "params", "token_count", "text", "finish_reason", "error", "error_code", "stats", "attempts", "created_at",
                  "started_at", "finished_at", "updated_at")
        read_only_fields = fields

    def get_error_code(self, instance: Session) -> str | None:
        return error_code(instance.error or "")

    def to_representation(self, instance: Session) -> dict[str, Any]:
        """The stored error is shown to staff; a tenant gets its stable message and ``error_code``."""
        data = super().to_representation(instance)
        data.update(public_error(instance.error or "", staff=is_staff(self.context.get("request"))))
        return data


# A page of sessions carries each prompt and text, and each text value of its params (a
# response_format is JSON text of up to 64 KiB), cut to this many characters (a page of 500 full
# sessions was tens of MB); the detail view (``GET /api/v1/sessions/{id}/``) has them whole.
LIST_TEXT_CAP = 256


def capped(text: str) -> tuple[str, bool]:
    """``text`` cut to ``LIST_TEXT_CAP`` characters, and whether it was cut."""
    return (text[:LIST_TEXT_CAP], True) if len(text) > LIST_TEXT_CAP else (text, False)


def params_summary(params: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
    """``params`` with each text value (and each text in a list) capped, and whether one was cut.

    Params are flat (the generation serializer writes them: numbers, short texts, a list of stop
    strings, a response_format as JSON text), so nothing deeper is walked.
    """
    summary, cut = {}, False
    for name, value in (params or {}).items():
        if isinstance(value, str):
            value, was_cut = capped(value)
        elif isinstance(value, list):
            pieces = [capped(item) if isinstance(item, str) else (item, False) for item in value[:LIST_TEXT_CAP]]
            was_cut = len(value) > LIST_TEXT_CAP or any(flag for _, flag in pieces)
            value = [item for item, _ in pieces]
        elif isinstance(value, dict):  # not written by the API; shown as a marker, not whole
            value, was_cut = "(an object; see the session)", True
        else:
            was_cut = False
        summary[name], cut = value, cut or was_cut
    return summary, cut


class SessionListSerializer(SessionSerializer):
    """A session as a list page shows it: ``prompt``, ``text`` and ``params`` capped, a flag saying
    each was cut."""

    prompt_truncated = serializers.SerializerMethodField(help_text=f"prompt was cut to {LIST_TEXT_CAP} characters.")
    text_truncated = serializers.SerializerMethodField(help_text=f"text was cut to {LIST_TEXT_CAP} characters.")
    params_truncated = serializers.SerializerMethodField(
        help_text=f"a text value of params (response_format) was cut to {LIST_TEXT_CAP} characters.")

    class Meta(SessionSerializer.Meta):
        fields = (*SessionSerializer.Meta.fields, "prompt_truncated", "text_truncated", "params_truncated")
        read_only_fields = fields

    def get_params_truncated(self, instance: Session) -> bool:
        return params_summary(instance.params)[1]

    def get_prompt_truncated(self, instance: Session) -> bool:
        return capped(instance.prompt)[1]

    def get_text_truncated(self, instance: Session) -> bool:
        return capped(instance.text)[1]

    def to_representation(self, instance: Session) -> dict[str, Any]:
        data = super().to_representation(instance)
        data["prompt"], data["text"] = capped(instance.prompt)[0], capped(instance.text)[0]
        data["params"] = params_summary(instance.params)[0]
        return data


class TokenSerializer(serializers.ModelSerializer):
    kind = serializers.CharField(source="get_kind_display")

    class Meta:
        model = TokenRecord
        fields = ("position", "step", "token_id", "piece", "kind", "logprob")


class CandidateSerializer(serializers.ModelSerializer):
    class Meta:
        model = Candidate
        fields = ("step", "branch", "token_ids", "score", "accepted_len")
