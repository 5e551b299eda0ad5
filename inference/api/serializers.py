from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

from django.http import QueryDict
from rest_framework import serializers

from core.parsers import BodyNotJSON, loads_json_field, nesting_depth
from inference import version_files
from inference.tokenizers import tokenizer_of
from inference.engine.config import GenerationConfig
from inference.engine.constraints import ConstraintError, OutputConstraint, constraint_from_response_format
from inference.engine.constraints.grammar import remember_constraint
from inference.engine.drafters import (
    DRAFTER_PARAMETERS,
    DRAFTERS,
    PARAMETER_NAMES,
    DrafterKind,
    DrafterParameter,
)
from inference.engine.errors import ConfigError
from inference.limits import (
    MAX_NEW_TOKENS,
    MAX_PROMPT_CHARS,
    MAX_RESPONSE_FORMAT_CHARS,
    MAX_SCHEMA_DEPTH,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_TEMPERATURE,
    MIN_TOP_P,
    TOP_P_RULE,
    temperature_rule,
)
from inference.served_targets import ModelNotServed, ModelUnavailable, cached_served_target, require_files
from inference.worker.session_params import is_deterministic
from metadata.models import ModelVersion


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return "null" if value is None else type(value).__name__


def _from_form(field: serializers.Field) -> bool:
    """Whether the body came as form fields (every value a string) rather than JSON."""
    return isinstance(getattr(field.root, "initial_data", None), QueryDict)


class StrictCharField(serializers.CharField):
    """A JSON string only: DRF's CharField would turn ``123`` into ``"123"``."""

    default_error_messages: ClassVar[dict[str, str]] = {"type": "must be a string; got {kind}."}

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("type", kind=_json_kind(data))
        return super().to_internal_value(data)


class StrictIntegerField(serializers.IntegerField):
    """A JSON number with an integral value (a string only from a form); never a boolean."""

    default_error_messages: ClassVar[dict[str, str]] = {"type": "must be a valid integer; got {kind}."}

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, (int, float, str)) or (
                isinstance(data, str) and not _from_form(self)):
            self.fail("type", kind=_json_kind(data))
        return super().to_internal_value(data)


class StrictFloatField(serializers.FloatField):
    """A JSON number (a string only from a form); never a boolean, never infinite or NaN."""

    default_error_messages: ClassVar[dict[str, str]] = {"type": "must be a valid number; got {kind}."}

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool) or not isinstance(data, (int, float, str)) or (
                isinstance(data, str) and not _from_form(self)):
            self.fail("type", kind=_json_kind(data))
        return super().to_internal_value(data)


class RequestJSONField(serializers.JSONField):
    """Any JSON value; from a form, the field's text is parsed with a JSON body's rules (nesting
    depth, NUL, lone surrogates: ``core.parsers``), so a form cannot send what a JSON body cannot."""

    def to_internal_value(self, data: Any) -> Any:
        if _from_form(self) and isinstance(data, (str, bytes)):
            try:
                return loads_json_field(data, self.field_name)
            except BodyNotJSON as exc:
                raise serializers.ValidationError(str(exc)) from None
        return super().to_internal_value(data)


def response_format_rule(value: Any) -> str | None:
    """Why ``value`` is too large a response_format to compile and store (None: it is not)."""
    depth = nesting_depth(value)
    if depth > MAX_SCHEMA_DEPTH:
        return f"must nest at most {MAX_SCHEMA_DEPTH} levels deep; got {depth}."
    size = len(json.dumps(value))
    if size > MAX_RESPONSE_FORMAT_CHARS:
        return f"must be at most {MAX_RESPONSE_FORMAT_CHARS} characters as JSON; got {size}."
    return None


def _drafter_choices() -> list[tuple[str, str]]:
    return [(kind.name, kind.summary) for kind in DRAFTERS.values()]


def _parameter_field(parameter: DrafterParameter) -> serializers.IntegerField:
    takers = ", ".join(kind.name for kind in DRAFTERS.values() if kind.takes(parameter.name))
    return StrictIntegerField(
        min_value=parameter.minimum, max_value=parameter.maximum, required=False,
        help_text=f"{parameter.help} (drafters {takers}; default {parameter.default}).")


class GenerationRequestSerializer(serializers.Serializer):
    """A generation request; ``validate`` checks it against the model it names.

    The drafter choices and each drafter's own parameters (``draft_length``, ``tree_width``, ...)
    come from the engine's drafter registry; a parameter the chosen drafter does not take is a
    400 naming the parameter and the drafter.
    """

    prompt = StrictCharField(trim_whitespace=False, max_length=MAX_PROMPT_CHARS)
    model = StrictCharField(required=False, help_text="Model name; default: the active target.")
    drafter = serializers.ChoiceField(
        choices=_drafter_choices(), required=False,
        help_text="Default: draft_model when the model has a draft, else ngram.")
    max_new_tokens = StrictIntegerField(min_value=1, max_value=MAX_NEW_TOKENS,
                                        default=GenerationConfig.max_new_tokens)
    temperature = StrictFloatField(
        min_value=0.0, max_value=MAX_TEMPERATURE, default=GenerationConfig.temperature,
        help_text=f"0 for greedy decoding, else from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}.")
    top_k = StrictIntegerField(min_value=0, max_value=MAX_TOP_K, default=GenerationConfig.top_k,
                               help_text="0 disables top-k.")
    top_p = StrictFloatField(min_value=MIN_TOP_P, max_value=1.0, default=GenerationConfig.top_p,
                             help_text=f"From {MIN_TOP_P:g} to 1; 1 disables top-p.",
                             error_messages=dict.fromkeys(("min_value", "max_value"), f"{TOP_P_RULE}; 1 disables top-p."))
    seed = StrictIntegerField(min_value=0, max_value=MAX_SEED, required=False)
    stop = serializers.ListField(
        child=StrictCharField(min_length=1, max_length=MAX_STOP_CHARS, trim_whitespace=False),
        max_length=MAX_STOP_SEQUENCES, default=list)
    response_format = RequestJSONField(
        required=False, allow_null=True,
        help_text='OpenAI\'s object: {"type": "text"} (default), {"type": "json_object"}, or '
                  '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}; the output is '
                  "then JSON that follows it; or SpecOps' "
                  '{"type": "grammar", "grammar": {"syntax": "lark", "definition": ...}} (docs/structured-output.md).')

    def to_internal_value(self, data: Any) -> dict:
        """Refuse fields this endpoint does not take, by name: a misspelt or foreign field (OpenAI's
        ``max_tokens``) would otherwise be dropped and the request run with a default."""
        if isinstance(data, Mapping):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                accepted = ", ".join(sorted(self.fields))
                raise serializers.ValidationError(
                    {name: [f"unknown field; this endpoint takes {accepted}."] for name in unknown})
        return super().to_internal_value(data)

    def get_fields(self) -> dict[str, serializers.Field]:
        fields = super().get_fields()
        fields.update({parameter.name: _parameter_field(parameter) for parameter in DRAFTER_PARAMETERS})
        return fields

    constraint: OutputConstraint | None = None  # the response_format's, once validated

    def validate_response_format(self, value: Any) -> dict | None:
        """A format too large, or one the engine cannot compile, is refused here, before anything is
        enqueued. Compiled without being remembered: ``remember_constraints`` once it is accepted
        (the context's ``checked_constraints`` compiled already in this request)."""
        rule = response_format_rule(value)
        if rule:
            raise serializers.ValidationError(rule)
        checked = self.context.get("checked_constraints", ())
        try:
            shape = constraint_from_response_format(value, compile=False)
            if shape is not None and shape not in checked:
                constraint_from_response_format(value, remember=False)
        except ConstraintError as error:
            raise serializers.ValidationError(str(error)) from None
        self.constraint = shape
        return value if shape is not None else None

    def remember_constraints(self, *others: OutputConstraint) -> None:
        """The request was accepted: its constraints (and ``others`` checked with it) need not be
        compiled again (``inference.engine.constraints.grammar``)."""
        for constraint in (self.constraint, *others):
            if constraint is not None:
                remember_constraint(constraint)

    def validate_temperature(self, value: float) -> float:
        if 0.0 < value < MIN_TEMPERATURE:
            raise serializers.ValidationError(f"{temperature_rule(MAX_TEMPERATURE)}; got {value:g}.")
        return value

    def validate(self, attrs: dict) -> dict:
        target = self._active_target(attrs.get("model"))
        kind = DRAFTERS[attrs.get("drafter") or ("draft_model" if target.default_draft_id else "ngram")]
        drafter = kind.name
        if kind.needs_draft_model and target.default_draft_id is None:
            raise serializers.ValidationError({"drafter": f"'{drafter}' needs a draft model; model "
                                               f"'{target.name}' has none (use 'ngram' or 'none')."})
        if kind.needs_dspark and not target.dspark_path:
            raise serializers.ValidationError({"drafter": f"'{drafter}' needs a DSpark drafter trained for the "
                                               f"target; model '{target.name}' has none (register one with "
                                               "register_model --dspark DIR, or use another drafter)."})
        drafter_params = self._drafter_params(kind, attrs)
        self._require_files(target, kind)
        prompt_tokens = len(tokenizer_of(target)(attrs["prompt"])["input_ids"])
        if prompt_tokens == 0:
            raise serializers.ValidationError({"prompt": "must contain at least one token."})
        room = target.context_length - prompt_tokens
        if "max_new_tokens" not in self.initial_data and 0 < room < attrs["max_new_tokens"]:
            attrs["max_new_tokens"] = room  # not the client's number but the default: what fits (a long chat)
        if prompt_tokens + attrs["max_new_tokens"] > target.context_length:
            field = "prompt" if prompt_tokens >= target.context_length else "max_new_tokens"
            raise serializers.ValidationError({field: (
                f"the prompt is {prompt_tokens} tokens and max_new_tokens is {attrs['max_new_tokens']}; "
                f"model '{target.name}' accepts at most {target.context_length} tokens in all.")})
        attrs.update(target=target, drafter=drafter, prompt_tokens=prompt_tokens, drafter_params=drafter_params,
                     draft=target.default_draft if kind.uses_draft_model else None)
        return attrs

    @staticmethod
    def _require_files(target: ModelVersion, kind: DrafterKind) -> None:
        """The files this request loads are on the host: the target's, and its draft's or DSpark
        drafter's when the drafter runs one; ``ModelUnavailable`` (left to the view: a 503) if not."""
        require_files(target)
        if kind.uses_draft_model and target.default_draft is not None:
            require_files(target.default_draft)
        if kind.needs_dspark:
            missing = version_files.missing_dspark(target)
            if missing is not None:
                raise ModelUnavailable(target, missing)

    @staticmethod
    def _drafter_params(kind: DrafterKind, attrs: dict) -> dict:
        """The drafter's parameters, given or default; one it does not take is refused by name."""
        for name in PARAMETER_NAMES:
            if name in attrs and not kind.takes(name):
                raise serializers.ValidationError({name: f"{kind.refusal(name)}."})
        params = kind.request_params(attrs, strict=False)  # refused above, by field
        try:
            kind.draft_config(params)
        except ConfigError as exc:
            raise serializers.ValidationError({"drafter": str(exc)}) from exc
        return params

    @staticmethod
    def _active_target(name: str | None) -> ModelVersion:
        """The model the request names; ``ModelBuilding`` (the first `make run`) is left to the view."""
        try:
            return cached_served_target(name)
        except ModelNotServed as exc:
            raise serializers.ValidationError({"model": exc.message}) from None

    def deterministic(self) -> bool:
        """Whether the request gives the same tokens every time (the prediction cache answers only those)."""
        return is_deterministic(self.params())

    def params(self) -> dict:
        """What the session row stores: sampling settings plus every parameter of its drafter."""
        keys = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop")
        params = {key: self.validated_data[key] for key in keys if key in self.validated_data}
        if self.validated_data.get("response_format") is not None:  # text is no constraint: not stored
            # as JSON text: a jsonb column reorders an object's keys, and a schema's properties are
            # generated in the order it lists them
            params["response_format"] = json.dumps(self.validated_data["response_format"])
        return {**params, **self.validated_data["drafter_params"]}


class GenerationAcceptedSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    status = serializers.CharField()
    queue = serializers.CharField()
    url = serializers.URLField()
    stream_url = serializers.URLField()
    tokens_url = serializers.URLField()


class ModelVersionSerializer(serializers.ModelSerializer):
    has_dspark = serializers.SerializerMethodField(
        help_text="Whether the target has a DSpark drafter (the `dspark` drafter runs on it).")

    class Meta:
        model = ModelVersion
        fields = ("id", "name", "version", "role", "device", "queue", "context_length", "status",
                  "default_draft", "has_dspark", "variant", "base", "figures", "created_at", "promoted_at")
        read_only_fields = fields

    def get_has_dspark(self, version: ModelVersion) -> bool:
        return bool(version.dspark_path)
