"""Register model directories as ModelVersions (idempotent), and the demo pair."""
from __future__ import annotations

from pathlib import Path

from django.db import transaction
from transformers import AutoConfig

from inference.conf import conf
from inference.engine.loading import (
    ModelLoadError,
    check_pair_directories,
    model_context_length,
)
from inference.models import ModelRole, ModelVersion, VersionStatus

DEMO_NAME = "demo"


class RegistrationError(Exception):
    """A model directory cannot be registered (missing, not a model, bad device, foreign draft)."""


def read_context_length(directory: Path) -> int:
    if not (directory / "config.json").is_file():
        raise RegistrationError(f"{directory} is not a model directory (no config.json)")
    return model_context_length(AutoConfig.from_pretrained(directory, local_files_only=True))


def _stored_path(directory: Path) -> str:
    """Store paths under SPECOPS_MODEL_DIR relative to it, so the directory can move."""
    try:
        return str(directory.resolve().relative_to(conf.MODEL_DIR.resolve()))
    except ValueError:
        return str(directory.resolve())


@transaction.atomic
def register_version(name: str, version: str, role: str, directory: Path, device: str = "cpu",
                     default_draft: ModelVersion | None = None, promote: bool = False) -> ModelVersion:
    """Create (or return the existing) version; optionally promote it."""
    if role not in ModelRole.values:
        raise RegistrationError(f"role must be one of {', '.join(ModelRole.values)}, not {role!r}")
    if device != "cpu" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise RegistrationError(f"device must be 'cpu' or 'cuda:N', not {device!r}")
    model_version, _ = ModelVersion.objects.get_or_create(
        name=name, version=version, role=role,
        defaults={"path": _stored_path(directory), "device": device,
                  "context_length": read_context_length(directory), "default_draft": default_draft},
    )
    if promote and model_version.status != VersionStatus.ACTIVE:
        model_version.promote()
    return model_version


@transaction.atomic
def register_pair(name: str, version: str, target_dir: Path, draft_dir: Path | None, device: str = "cpu",
                  promote: bool = True) -> ModelVersion:
    """Register a target with its draft as its default draft; return the target version.

    The draft must share the target's tokenizer and EOS (checked from the directories' tokenizers,
    before anything is written); otherwise a one-line RegistrationError names both directories.
    """
    draft = None
    if draft_dir is not None:
        read_context_length(target_dir)
        read_context_length(draft_dir)
        try:
            check_pair_directories(target_dir, draft_dir)
        except ModelLoadError as exc:
            raise RegistrationError(str(exc)) from exc
        draft = register_version(name, version, ModelRole.DRAFT, draft_dir, device, promote=promote)
    return register_version(name, version, ModelRole.TARGET, target_dir, device, default_draft=draft,
                            promote=promote)
