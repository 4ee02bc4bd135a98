"""What a new user meets on the first try (issue 26, "the smaller ones"): the line they see.

A save into a folder that does not exist, ``ckptkit audit --help``'s defaults, and
``ckptkit inspect``'s run state for a checkpoint without a rollback record.
"""

from __future__ import annotations

import dataclasses
import io
import os
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.cli import main


def test_a_save_into_a_missing_folder_names_the_folder_and_creates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's ``ckptkit.save("run/step-00000100.ckpt", ...)`` before ``run/`` exists.

    Not created: a mistyped or unmounted path must fail, not fill the wrong disk.
    """
    monkeypatch.chdir(tmp_path)
    ckpt = ckptkit.Checkpoint(step=100, model={"w": torch.ones(2)})
    with pytest.raises(ckptkit.SaveFailed) as e:
        ckptkit.save("run/step-00000100.ckpt", ckpt)
    assert str(e.value) == (
        "run/step-00000100.ckpt: the folder run does not exist; create it first (os.makedirs('run', exist_ok=True)): "
        "ckptkit does not create it, so that a mistyped or unmounted path is an error, not checkpoints on the "
        "wrong disk"
    )
    assert isinstance(e.value, OSError) and os.listdir(tmp_path) == []
    os.makedirs("run", exist_ok=True)
    ckptkit.save("run/step-00000100.ckpt", ckpt)
    assert ckptkit.load("run/step-00000100.ckpt").step == 100


def _help(command: str) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main([command, "--help"]) == 0
    return " ".join(out.getvalue().split())  # argparse wraps at the terminal's width


def test_audit_help_states_the_defaults_the_audit_runs() -> None:
    text = _help("audit")
    assert "train until this many steps are done (a resume may extend it), >= 0 (default: 10;" in text
    assert "(default: 1; config key train.ckpt_every)" in text
    assert "(default: steps+1; config key train.keep)" in text
    assert "(default: 200;" in _help("train")  # the trainer's own default is unchanged


@dataclasses.dataclass
class Cfg:
    lr: float = 0.1


def test_inspect_shows_the_run_state_of_a_checkpoint_without_a_rollback_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = ckptkit.RunState(tmp_path, config=Cfg())
    state.add_model("net", torch.nn.Linear(2, 2))
    position = [640]
    state.add_data_position("train", get=lambda: position[0], set=lambda p: position.__setitem__(0, p))
    state.add_value("epoch", get=lambda: 3, set=lambda _v: None)
    state.start()
    path = state.save(5)
    assert main(["inspect", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("run state (monitor section):")
    assert lines[at + 1 :] == [
        "  data positions  train=640",
        "  monitors        -",
        "  values          epoch",
        "  companions      environment, sidecars, snapshot",
        "rollback: none recorded",
        "digests: not checked here (ckptkit verify checks every byte)",
    ]
