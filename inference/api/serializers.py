from __future__ import annotations

from rest_framework import serializers

from inference.api.tokenizers import count_tokens
from inference.models import ModelRole, ModelVersion, VersionStatus

DRAFTERS = ("draft_model", "tree", "ngram", "none")
NEEDS_DRAFT_MODEL = ("draft_model", "tree")


class GenerationRequestSerializer(serializers.Serializer):
    """A generation request; ``validate`` checks it against the model it names."""

    prompt = serializers.CharField(trim_whitespace=False, max_length=100_000)
    model = serializers.CharField(required=False, help_text="Model name; default: the active target.")
    drafter = serializers.ChoiceField(choices=DRAFTERS, required=False)
    max_new_tokens = serializers.IntegerField(min_value=1, max_value=2048, default=64)
    temperature = serializers.FloatField(min_value=0.0, max_value=5.0, default=0.0)
    top_k = serializers.IntegerField(min_value=0, default=0)
    top_p = serializers.FloatField(min_value=0.0, max_value=1.0, default=1.0)
    seed = serializers.IntegerField(min_value=0, max_value=2**63 - 1, required=False)
    stop = serializers.ListField(child=serializers.CharField(min_length=1, max_length=64, trim_whitespace=False),
                                 max_length=4, default=list)
    draft_length = serializers.IntegerField(min_value=1, max_value=8, default=4)

    def validate_top_p(self, value: float) -> float:
        if value <= 0.0:
            raise serializers.ValidationError("must be greater than 0 and at most 1.")
        return value

    def validate(self, attrs: dict) -> dict:
        target = self._active_target(attrs.get("model"))
        drafter = attrs.get("drafter") or ("draft_model" if target.default_draft_id else "ngram")
        if drafter in NEEDS_DRAFT_MODEL and target.default_draft_id is None:
            raise serializers.ValidationError({"drafter": f"'{drafter}' needs a draft model; model "
                                               f"'{target.name}' has none (use 'ngram' or 'none')."})
        prompt_tokens = count_tokens(str(target.directory), attrs["prompt"])
        if prompt_tokens == 0:
            raise serializers.ValidationError({"prompt": "must contain at least one token."})
        if prompt_tokens + attrs["max_new_tokens"] > target.context_length:
            field = "prompt" if prompt_tokens >= target.context_length else "max_new_tokens"
            raise serializers.ValidationError({field: (
                f"the prompt is {prompt_tokens} tokens and max_new_tokens is {attrs['max_new_tokens']}; "
                f"model '{target.name}' accepts at most {target.context_length} tokens in all.")})
        attrs.update(target=target, drafter=drafter, prompt_tokens=prompt_tokens,
                     draft=target.default_draft if drafter in NEEDS_DRAFT_MODEL else None)
        return attrs

    @staticmethod
    def _active_target(name: str | None) -> ModelVersion:
        targets = ModelVersion.objects.filter(role=ModelRole.TARGET, status=VersionStatus.ACTIVE)
        if name:
            targets = targets.filter(name=name)
        target = targets.select_related("default_draft").order_by("-promoted_at").first()
        if target is None:
            detail = f"no active target model named '{name}'." if name else "no active target model is registered."
            raise serializers.ValidationError({"model": detail})
        return target

    def params(self) -> dict:
        keys = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "draft_length")
        return {key: self.validated_data[key] for key in keys if key in self.validated_data}


class GenerationAcceptedSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    status = serializers.CharField()
    queue = serializers.CharField()
    url = serializers.URLField()
    stream_url = serializers.URLField()
    tokens_url = serializers.URLField()


class ModelVersionSerializer(serializers.ModelSerializer):
    class Meta:
        model = ModelVersion
        fields = ("id", "name", "version", "role", "device", "queue", "context_length", "status",
                  "default_draft", "created_at", "promoted_at")
        read_only_fields = fields
