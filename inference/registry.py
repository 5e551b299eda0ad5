"""Register model directories as ModelVersions (idempotent), and the demo pair.

The demo pair comes in two versions: `quick-<seed>`, built in seconds so that a first run
serves at once, and `seed<seed>`, the full pair that trains in the background and replaces
it (`register_demo_pair` decides which is promoted). `pending_build` tells the API that a
requested model is still being built (a 503 with Retry-After, not a 404 nor a hang).
`promote_version` is how the REST API and the admin promote: only to a device a running worker
serves.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from django.db import transaction

from inference import version_files
from inference.build_records import BUILDING, STALLED, build_record, build_records
from inference.conf import conf
from metadata.models import LoadDtype, ModelRole, ModelVersion, VersionStatus

logger = logging.getLogger(__name__)

DEMO_NAME = "demo"
QUICK_PREFIX = "quick-"


def quick_version(seed: int) -> str:
    """The version of the quick demo pair: `quick-0`."""
    return f"{QUICK_PREFIX}{seed}"


def full_version(seed: int) -> str:
    """The version of the full demo pair: `seed0` (what `build_demo_models` always registered)."""
    return f"seed{seed}"


def split_model_id(model: str) -> tuple[str, str | None]:
    """`demo:seed0` -> ("demo", "seed0"); `demo` -> ("demo", None): how a request names a version."""
    name, colon, version = model.partition(":")
    return (name, version) if colon and version else (name, None)


class RegistrationError(Exception):
    """A model directory cannot be registered (missing, not a model, bad device, foreign draft)."""


def read_model_facts(directory: Path) -> tuple[int, str]:
    """The directory's context length and the attention the engine will load it with, from its config.

    A model the engine cannot serve (cache layers it cannot roll back, layouts its masks cannot
    express) is refused here with the engine's one-line reason, never at its first request.
    """
    if not (directory / "config.json").is_file():
        raise RegistrationError(f"{directory} is not a model directory (no config.json)")
    from transformers import AutoConfig

    from inference.engine.lm.loading import ModelLoadError, check_servable, model_context_length

    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    try:
        attn_implementation = check_servable(config)
    except ModelLoadError as exc:
        raise RegistrationError(f"{directory}: {exc}") from exc
    return model_context_length(config), attn_implementation


def _stored_path(directory: Path) -> str:
    """Store paths under SPECOPS_MODEL_DIR relative to it, so the directory can move."""
    try:
        return str(directory.resolve().relative_to(conf.MODEL_DIR.resolve()))
    except ValueError:
        return str(directory.resolve())


@transaction.atomic
def register_version(name: str, version: str, role: str, directory: Path, device: str = "cpu",
                     default_draft: ModelVersion | None = None, promote: bool = False,
                     dtype: str = LoadDtype.DEFAULT) -> ModelVersion:
    """Create (or return the existing) version; optionally promote it."""
    if role not in ModelRole.values:
        raise RegistrationError(f"role must be one of {', '.join(ModelRole.values)}, not {role!r}")
    if device != "cpu" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise RegistrationError(f"device must be 'cpu' or 'cuda:N', not {device!r}")
    if dtype not in LoadDtype.values:
        raise RegistrationError(f"dtype must be one of {', '.join(v for v in LoadDtype.values if v)}, not {dtype!r}")
    context_length, attn_implementation = read_model_facts(directory)
    model_version, _ = ModelVersion.objects.get_or_create(
        name=name, version=version, role=role,
        defaults={"path": _stored_path(directory), "device": device, "context_length": context_length,
                  "attn_implementation": attn_implementation, "default_draft": default_draft, "dtype": dtype},
    )
    if promote and model_version.status != VersionStatus.ACTIVE:
        model_version.promote()
    return model_version


def check_dspark_directory(target_dir: Path, dspark_dir: Path) -> None:
    """RegistrationError (one line) unless `dspark_dir` is a DSpark checkpoint that fits the target."""
    from inference.engine.drafters.dspark import DSparkLoadError, load_dspark
    from inference.engine.lm.loading import ModelLoadError, load_causal_lm

    try:
        target = load_causal_lm(target_dir)
        load_dspark(dspark_dir, target.model)
    except (DSparkLoadError, ModelLoadError) as exc:
        raise RegistrationError(str(exc)) from exc


def attach_dspark(target: ModelVersion, dspark_dir: Path) -> ModelVersion:
    """Make `dspark_dir` the DSpark drafter of `target`, after checking that it fits."""
    if target.role != ModelRole.TARGET:
        raise RegistrationError(f"{target} is a {target.role}: only a target has a DSpark drafter")
    check_dspark_directory(target.directory, dspark_dir)
    target.dspark_path = _stored_path(dspark_dir)
    target.save(update_fields=["dspark_path"])
    return target


@transaction.atomic
def register_pair(name: str, version: str, target_dir: Path, draft_dir: Path | None, device: str = "cpu",
                  promote: bool = True, dspark_dir: Path | None = None,
                  dtype: str = LoadDtype.DEFAULT) -> ModelVersion:
    """Register a target with its draft as its default draft; return the target version.

    The draft must share the target's tokenizer and EOS (checked from the directories' tokenizers,
    before anything is written); otherwise a one-line RegistrationError names both directories.
    """
    from inference.engine.lm.loading import ModelLoadError, check_pair_directories

    draft = None
    if draft_dir is not None:
        read_model_facts(target_dir)
        read_model_facts(draft_dir)
        try:
            check_pair_directories(target_dir, draft_dir)
        except ModelLoadError as exc:
            raise RegistrationError(str(exc)) from exc
        draft = register_version(name, version, ModelRole.DRAFT, draft_dir, device, promote=promote, dtype=dtype)
    if dspark_dir is not None:
        check_dspark_directory(target_dir, dspark_dir)  # before anything is written
    target = register_version(name, version, ModelRole.TARGET, target_dir, device, default_draft=draft,
                              promote=promote, dtype=dtype)
    if dspark_dir is not None:
        attach_dspark(target, dspark_dir)
    return target


def _active_demo_target(name: str) -> ModelVersion | None:
    return ModelVersion.objects.filter(name=name, role=ModelRole.TARGET, status=VersionStatus.ACTIVE).first()


def _match_built(version: ModelVersion, directory: Path) -> None:
    """Keep a demo version's row true to the pair just built into ``directory``.

    Its version name stays when its recipe changes (the quick pair's context grew), so the facts
    read at registration are read again; and a row whose files this host lacks (it came with a
    database shared with another checkout, or its folder moved) points at the built pair instead.
    """
    changed = []
    if version.directory.resolve() != directory.resolve():
        missing = version_files.missing_files(version)
        if missing is None:
            return  # another whole copy, chosen by whoever registered it
        logger.warning("%s: its files are missing (%s); it now points at %s, just built", version, missing, directory)
        version.path = _stored_path(directory)
        changed.append("path")
    context_length, attn_implementation = read_model_facts(directory)
    if (version.context_length, version.attn_implementation) != (context_length, attn_implementation):
        version.context_length, version.attn_implementation = context_length, attn_implementation
        changed += ["context_length", "attn_implementation"]
    if changed:
        version.save(update_fields=changed)


def register_demo_pair(version: str, target_dir: Path, draft_dir: Path, device: str = "cpu",
                       name: str = DEMO_NAME) -> tuple[ModelVersion, bool]:
    """Register a demo pair and promote it when it should serve; return (target, promoted).

    A quick pair is promoted only when no `name` target is active, or when the active one's files
    are missing on this host (a later `make run` must not demote the full pair, and must serve a
    pair it has the files of); the full pair too, or when the active one is a quick pair (it never
    replaces a version an operator chose while that version's files are there). Promotion is the
    ordinary one: the `model_promoted` signal, after commit, invalidates the replaced versions'
    cached predictions.
    """
    with transaction.atomic():
        target = register_pair(name, version, target_dir, draft_dir, device=device, promote=False)
        _match_built(target, target_dir)
        if target.default_draft is not None:
            _match_built(target.default_draft, draft_dir)
        active = _active_demo_target(name)
        quick = version.startswith(QUICK_PREFIX)
        if active is not None and active.pk == target.pk:
            return target, False
        if (active is None or version_files.missing_files(active) is not None
                or (not quick and active.version.startswith(QUICK_PREFIX))):
            if target.default_draft is not None:
                target.default_draft.promote()
            target.promote()
            return target, True
    return target, False


def pending_build(model: str, version: str | None = None) -> dict[str, Any] | None:
    """Whether a request for `model` must wait for a build: a dict for a 503, else None.

    `model` is a name (`demo`) or a name and version (`demo:seed0`). None when the model is
    active (serve it) or no build of it is under way (unknown: a 404). Otherwise the build's
    record (see `inference.build_records`) plus `retry_after_s` (for the Retry-After header:
    the build's ETA, between 5 s and 5 min) and `message` (one sentence naming the model).
    A plain name is pending only while it has no active target at all (e.g. `demo` while the
    quick pair builds); a name with a version, until that version is active.
    """
    name, named_version = split_model_id(model)
    version = version or named_version
    active = ModelVersion.objects.filter(name=name, role=ModelRole.TARGET, status=VersionStatus.ACTIVE)
    if version is not None:
        active = active.filter(version=version)
    if active.exists():
        return None
    if version is not None:
        record = build_record(name, version)
        records = [record] if record is not None else []
    else:
        records = build_records(name)
    running = [r for r in records if r["state"] in (BUILDING, STALLED)]
    if not running:
        return None
    record = running[0]
    eta = record.get("eta_s")
    retry_after = int(min(300, max(5, eta if eta is not None else 30)))
    where = f"{record['phase']} {record['step']}/{record['total']}" if record["phase"] else "starting"
    wait = f"about {round(eta / 60)} min" if eta is not None and eta >= 90 else f"{retry_after} s"
    record.update(
        model=f"{name}:{record['version']}", retry_after_s=retry_after,
        message=(f"model '{model}' is still being built ({name}:{record['version']}: {where}); "
                 f"try again in {wait}."),
    )
    return record


# How long a promotion waits for the running workers to say which queues they consume.
SERVED_QUEUES_TIMEOUT_S = 1.0


class DeviceNotServed(RegistrationError):
    """No running worker consumes the version's device queue: promoted, it would take every
    request of its name to a queue nobody reads (they failed an hour later)."""


def served_queues(timeout: float | None = None) -> set[str] | None:
    """The queues the running Celery workers consume, from their answers to an ``active_queues``
    broadcast (Celery's remote control: each worker announces its own queues); None when no
    worker answers within ``timeout`` (none runs, or their control channel is off: unknown)."""
    from celery import current_app

    timeout = SERVED_QUEUES_TIMEOUT_S if timeout is None else timeout
    try:
        replies = current_app.control.inspect(timeout=timeout).active_queues()
    except Exception:  # the broker is unreachable: unknown, as when nobody answers
        logger.warning("promotion: the workers' queues could not be asked", exc_info=True)
        return None
    if not replies:
        return None
    return {queue["name"] for queues in replies.values() for queue in (queues or ())}


def check_device_served(version: ModelVersion) -> None:
    """Raise ``DeviceNotServed`` when workers answer and none consumes ``version``'s device queue.

    When no worker answers at all, nothing is known (the version's queue may be served by a
    worker that is busy or not yet started): the promotion goes ahead, with a warning logged.
    """
    served = served_queues()
    if served is None:
        logger.warning("promotion of %s: no worker answered within %.1f s; its queue %s is not checked",
                       version, SERVED_QUEUES_TIMEOUT_S, version.queue)
        return
    if version.queue not in served:
        raise DeviceNotServed(
            f"no running worker serves device {version.device} (queue {version.queue}); the workers that "
            f"answered consume {', '.join(sorted(served))}. Start one (celery -A specops worker -Q "
            f"{version.queue}, SPECOPS_WORKER_DEVICE={version.device}) before promoting {version}.")


def promote_version(version: ModelVersion) -> list[ModelVersion]:
    """Promote ``version`` (one transaction: a concurrent promotion of its name waits on the row
    locks ``ModelVersion.promote`` takes) once a worker serves its device; return what it replaced."""
    check_device_served(version)
    with transaction.atomic():
        return version.promote()
