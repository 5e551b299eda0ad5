"""Build an optimised variant (int8, bf16, compiled) of a registered model version."""
from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from inference.engine.lm.variants import VARIANT_KINDS
from metadata.models import ModelRole, ModelVersion
from inference.variant_registry import VariantBuildError, build_variant


class Command(BaseCommand):
    help = ("Build the int8, bf16 or compiled variant of a version beside its directory and register it "
            "(staged) as <version>+<kind>, with its recipe and measured figures.")

    def add_arguments(self, parser) -> None:
        parser.add_argument("name")
        parser.add_argument("version")
        parser.add_argument("--kind", required=True, action="append", dest="kinds",
                            help=f"one of {', '.join(VARIANT_KINDS)}; repeat for several")
        parser.add_argument("--role", default=ModelRole.TARGET, help="draft or target (default target)")
        parser.add_argument("--no-measure", action="store_true", help="record the size only, not speed or agreement")

    def handle(self, *args, name, version, kinds, role, no_measure, **options) -> None:
        if role not in ModelRole.values:
            raise CommandError(f"--role must be one of {', '.join(ModelRole.values)}, not {role!r}")
        unknown = [kind for kind in kinds if kind not in VARIANT_KINDS]
        if unknown:
            raise CommandError(f"--kind must be one of {', '.join(VARIANT_KINDS)}, not {unknown[0]!r}")
        try:
            base = ModelVersion.objects.select_related("base", "default_draft").get(
                name=name, version=version, role=role)
        except ModelVersion.DoesNotExist:
            raise CommandError(f"no {role} version {name}:{version} is registered") from None
        for kind in kinds:
            self.stdout.write(f"building the {kind} variant of {base} ...")
            try:
                variant = build_variant(base, kind, measure=not no_measure)
            except VariantBuildError as exc:
                raise CommandError(str(exc)) from exc
            self.stdout.write(f"registered {variant} (staged) at {variant.directory}: {_summary(variant.figures)}")


def _summary(figures: dict) -> str:
    parts = [f"size {figures['size_bytes'] / 1e6:.2f} MB (base {figures['base_size_bytes'] / 1e6:.2f} MB)"]
    if "forward_ms_1" in figures:
        parts.append(f"forward 1 token {figures['forward_ms_1']:.2f} ms (base {figures['base_forward_ms_1']:.2f})")
        parts.append(f"5 tokens {figures['forward_ms_5']:.2f} ms (base {figures['base_forward_ms_5']:.2f})")
        parts.append(f"top-1 agreement with base {figures['top1_agreement_with_base']:.3f}")
    return ", ".join(parts)
