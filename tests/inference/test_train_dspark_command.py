"""`manage.py train_dspark`: trains a loadable DSpark drafter for a target directory or a
registered target, and refuses bad input with one line, writing nothing."""
from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from inference.engine.drafters.dspark import load_dspark
from inference.engine.lm.loading import load_causal_lm


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    from inference.demo.tiny_models import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.mktemp("models"), arch="llama", seed=0)


def train(*args) -> str:
    out = StringIO()
    call_command("train_dspark", *map(str, args), stdout=out)
    return out.getvalue()


def test_it_trains_a_drafter_that_loads_for_the_target(llama_pair, tmp_path):
    target_dir = llama_pair[0]
    out = tmp_path / "dspark"
    printed = train("--target", target_dir, "--out", out, "--minutes", "0.02", "--sequences", "6",
                    "--block-size", "3", "--threads", "1")
    model = load_dspark(out, load_causal_lm(target_dir).model)
    assert model.block_size == 3 and model.calibration is not None
    assert f"dspark drafter written to {out}" in printed and "tau greedy" in printed
    assert "dspark_text" in printed and "train_dspark" in printed  # the phases, as they start


@pytest.mark.django_db
def test_a_registered_target_is_found_by_name(llama_pair):
    from inference.management.commands.train_dspark import resolve_target

    call_command("register_model", "tiny", "1", str(llama_pair[0]), "--draft", str(llama_pair[1]), stdout=StringIO())
    assert resolve_target("tiny").resolve() == llama_pair[0].resolve()
    assert resolve_target("tiny:1").resolve() == llama_pair[0].resolve()
    with pytest.raises(CommandError, match="neither a model directory nor a registered target"):
        resolve_target("tiny:2")


@pytest.mark.django_db
@pytest.mark.parametrize(("args", "message"), [
    (["--minutes", "0"], "--minutes must be positive"),
    (["--block-size", "0"], "--block-size must be between 1 and 16"),
    (["--block-size", "40"], "--block-size must be between 1 and 16"),
    (["--sequences", "1"], "--sequences must be at least 2"),
    (["--target", "no-such-model"], "neither a model directory nor a registered target"),
    (["--out", "{file}"], "exists and is not a directory"),
    (["--out", "{busy}"], "not a DSpark checkpoint; refusing to replace it"),
    (["--out", "{target}"], "the target's own directory"),
    (["--target", "{file}"], "is a file, not a model directory"),
])
def test_bad_input_is_one_line_and_writes_nothing(llama_pair, tmp_path, args, message):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep me")
    paths = {"file": tmp_path / "a-file", "busy": tmp_path / "busy", "target": llama_pair[0]}
    defaults = {"--target": str(llama_pair[0]), "--out": str(tmp_path / "dspark")}
    given = dict(zip(args[::2], (value.format(**paths) for value in args[1::2])))
    argv = [item for key, value in {**defaults, **given}.items() for item in (key, value)]
    with pytest.raises(CommandError, match=message) as refused:
        train(*argv)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "dspark").exists()
    assert (tmp_path / "busy" / "notes.txt").read_text() == "keep me"
