"""Register a local model directory (save_pretrained layout) as a model version."""
from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from inference.engine.lm.loading import unapplied_generation_settings
from metadata.models import LoadDtype, ModelRole
from inference.registry import RegistrationError, register_pair, register_version


class Command(BaseCommand):
    help = "Register a target (optionally with its draft) or a draft model directory."

    def add_arguments(self, parser) -> None:
        parser.add_argument("name")
        parser.add_argument("version")
        parser.add_argument("path", type=Path)
        parser.add_argument("--role", choices=ModelRole.values, default=ModelRole.TARGET)
        parser.add_argument("--draft", type=Path, help="Draft model directory for a target.")
        parser.add_argument("--dspark", type=Path,
                            help="A DSpark checkpoint directory (DeepSpec's layout) trained for the target.")
        parser.add_argument("--device", default="cpu")
        parser.add_argument("--dtype", choices=[value for value in LoadDtype.values if value], default="",
                            help="Load in this dtype (default: float32 on a CPU, the checkpoint's own on cuda).")
        parser.add_argument("--promote", action="store_true")

    def handle(self, *args, name, version, path, role, draft, dspark, device, dtype, promote, **options) -> None:
        try:
            if dspark is not None and role != ModelRole.TARGET:
                raise CommandError("--dspark: only a target has a DSpark drafter (drop --role or --dspark)")
            if role == ModelRole.TARGET:
                registered = register_pair(name, version, path, draft, device=device, promote=promote,
                                           dspark_dir=dspark, dtype=dtype)
            else:
                registered = register_version(name, version, role, path, device=device, promote=promote,
                                              dtype=dtype)
        except (RegistrationError, OSError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"registered {registered} on {registered.device} (queue {registered.queue}, "
                          f"{registered.attn_implementation} attention, {registered.dtype or 'default'} dtype)"
                          + (f" with the DSpark drafter {registered.dspark_path}" if registered.dspark_path else ""))
        unapplied = unapplied_generation_settings(path) if role == ModelRole.TARGET else []
        if unapplied:
            self.stdout.write(f"note: {path}/generation_config.json sets {', '.join(unapplied)}; the engine does "
                              "not apply these (it samples from the model's own logits), so its outputs may "
                              "differ from transformers' generate with the checkpoint's defaults")
