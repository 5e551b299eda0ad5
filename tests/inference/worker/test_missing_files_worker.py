"""A version's directory removed under a running worker: the APIs refuse its requests with a 503
naming it, the worker goes on serving the other models, and a session of a version it had not
loaded fails with what is missing (it was an `HFValidationError`: the path taken for a Hub id)."""
from __future__ import annotations

import shutil

import pytest

from inference import version_files
from metadata.models import ModelRole
from inference.registry import register_pair, register_version
from inference.tasks import generate
from metadata.models import Session
from specops.celery import app
from tests.helpers import wait_for
from tests.worker_process import start_worker, stop_worker

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

REST = "/api/v1/generations/"


@pytest.fixture
def cpu_worker(tiny_model, tmp_path):
    app.control.purge()  # the tests' own broker database: nothing left from an earlier run runs here
    process = start_worker("cpu", "files-cpu", tmp_path / "worker.log", extra_env={"OMP_NUM_THREADS": "1"})
    yield process
    stop_worker(process)


def ended(session_id) -> Session | None:
    session = Session.objects.get(pk=session_id)
    return session if session.finished_at else None


def test_a_directory_removed_under_a_running_worker(api_client, tenant, tiny_model, tiny_model_dirs, tmp_path,
                                                    cpu_worker):
    target_dir, draft_dir = tiny_model_dirs
    gone_target = shutil.copytree(target_dir, tmp_path / "gone-target")
    register_pair("gone", "1", gone_target, shutil.copytree(draft_dir, tmp_path / "gone-draft"))
    lost = register_version("lost", "1", ModelRole.TARGET, shutil.copytree(target_dir, tmp_path / "lost-target"))

    shutil.rmtree(gone_target)
    shutil.rmtree(lost.directory)
    version_files.forget()

    refused = api_client.post(REST, {"model": "gone", "prompt": "def f():", "max_new_tokens": 8}, format="json")
    assert refused.status_code == 503, refused.content
    assert "model 'gone' is unavailable" in refused.json()["detail"] and str(gone_target) in refused.json()["detail"]

    # a session of a version the worker never loaded (enqueued before its files went): failed, with the reason
    lost_session = Session.objects.create(tenant=tenant, target=lost, drafter="ngram", queue="cpu", prompt="x",
                                          prompt_tokens=1, params={"max_new_tokens": 4})
    generate.apply_async(args=[str(lost_session.pk)], queue="cpu")
    failed = wait_for(lambda: ended(lost_session.pk), timeout=120, what="the lost version's session to end")
    assert failed.status == "failed"
    assert failed.error == (f"VersionFilesMissing: the files of lost:1 (target) are missing or unreadable on this "
                            f"host: its directory {lost.directory} does not exist")

    # the same worker serves the other model, before and after
    served = api_client.post(REST, {"model": "tiny", "prompt": "def f():", "max_new_tokens": 8,
                                    "drafter": "draft_model"}, format="json")
    assert served.status_code == 202, served.content
    done = wait_for(lambda: ended(served.json()["id"]), timeout=120, what="the tiny model's session to end")
    assert done.status == "succeeded" and done.token_count == 8, done.error
