"""A Hugging Face ``Trainer`` run recorded, audited, replayed and self-checked (spec/transformers.md R-HF07..R-HF09).

The real ``transformers.Trainer`` on the tiny GPT-2 of ``examples/hf_finetune.py`` (CPU, dropout
on, ``full_determinism``). In-process where the behaviour is the recording's; ``ckptkit audit``
and ``ckptkit replay`` run the example as the user would, each run a process of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from _hf_worker import StopAt  # ends training after step n, as a kill there would (nothing saved at n)

from ckptkit import Checkpoint, FormatError, ReplayDivergence, RunStopped, UnsupportedOption
from ckptkit.audit._recording import checkpoint_difference
from ckptkit.cli import main
from ckptkit.format._checkpoint import load, save
from ckptkit.integrations import _hf_record, _run_record
from ckptkit.integrations.hf_folder import STATE_FILE
from ckptkit.run import read_rows
from ckptkit.run._files import TRAINER_COMMIT, run_checkpoints

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_finetune.py"
sys.path.insert(0, str(EXAMPLE.parent))
from hf_finetune import make_trainer  # noqa: E402


def _rows(out: Path, kind: str) -> list[dict[str, Any]]:
    return [r for r in read_rows(out / "history.jsonl")[0] if r["kind"] == kind]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """8 steps with gradient accumulation 2, logged every step; checkpoints at 2, 4, 6, 8."""
    out = tmp_path_factory.mktemp("hf") / "out"
    trainer = make_trainer(str(out), args={"gradient_accumulation_steps": 2, "logging_steps": 1})
    trainer.train()
    return out, [log for log in trainer.state.log_history if "loss" in log]


def test_each_step_row_holds_the_loss_grad_norm_and_lr_trainer_logs_bit_for_bit(
    run: tuple[Path, list[dict[str, Any]]],
) -> None:
    out, logs = run
    steps = _rows(out, "step")
    assert [r["step"] for r in steps] == list(range(8))
    for row, log in zip(steps, logs, strict=True):
        assert (row["loss"], row["grad_norm"], row["lr"]) == (log["loss"], log["grad_norm"], log["learning_rate"])
        assert row["loss_bits"].startswith("0x") and len(row["loss_bits"]) == 10  # the float32 Trainer sums
        assert row["data"].startswith("0x")
    digests = _rows(out, "digests")
    assert [r["step"] for r in digests] == list(range(1, 9))  # the default: every step, the state is small
    names = digests[0]["tensors"]
    assert "model:model.transformer.h.0.attn.c_attn.weight" in names
    assert "optim:optimizers.optimizer.state.0.exp_avg" in names
    facts = json.loads((out / "environment.json").read_text())
    assert {"torch", "transformers", "accelerate"} <= set(facts)


def test_a_committed_checkpoint_folder_is_a_run_checkpoint_and_a_torn_one_is_not(
    run: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    out, _ = run
    assert TRAINER_COMMIT == STATE_FILE
    shutil.copytree(out, tmp_path / "out")
    os.remove(tmp_path / "out" / "checkpoint-8" / STATE_FILE)
    assert sorted(run_checkpoints(tmp_path / "out")) == [2, 4, 6]


def test_two_folders_are_compared_by_their_state_not_by_their_snapshot(
    run: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    out, _ = run
    a, b = out / "checkpoint-4", tmp_path / "checkpoint-4"
    shutil.copytree(a, b)
    snapshot = b / "ckptkit.config.json"
    snapshot.write_text(snapshot.read_text().replace(str(out), str(tmp_path)))  # another output_dir: exempt
    assert checkpoint_difference(4, str(a), str(b)) is None
    ckpt = load(b / STATE_FILE)
    ckpt.optim["optimizers"]["optimizer"]["state"][0]["exp_avg"].view(-1)[0] += 1.0
    save(b / STATE_FILE, Checkpoint(step=4, optim=ckpt.optim, monitor=ckpt.monitor))
    d = checkpoint_difference(4, str(a), str(b))
    assert d is not None and [t.name for t in d.tensors] == ["optim:optimizers.optimizer.state.0.exp_avg"]
    (b / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(FormatError) as info:
        checkpoint_difference(4, str(a), str(b))
    assert str(info.value).startswith(f"{b / 'model.safetensors'}: not a readable safetensors file (")


def test_digests_every_sets_the_cadence_and_a_large_state_is_digested_at_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_trainer(str(tmp_path / "three"), steps=6, save_steps=4, digests_every=3).train()
    assert [r["step"] for r in _rows(tmp_path / "three", "digests")] == [3, 6]
    monkeypatch.setattr(_run_record, "SMALL_STATE", 0)
    make_trainer(str(tmp_path / "large"), steps=6, save_steps=4).train()
    assert [r["step"] for r in _rows(tmp_path / "large", "digests")] == sorted(run_checkpoints(tmp_path / "large"))
    assert sorted(run_checkpoints(tmp_path / "large")) == [4, 6]  # Trainer saves the last step too
    assert len(_rows(tmp_path / "large", "step")) == 6


def test_a_batch_without_a_digest_leaves_the_data_field_out_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rec = make_trainer(str(tmp_path))._ckptkit_recorder
    assert rec is not None
    row: dict[str, Any] = {}
    for _ in range(2):
        rec.inputs = [{"input_ids": object()}]
        rec._add_data(row)
    assert row == {}
    said = (
        "history.jsonl: step rows record no data digest: data.0.input_ids: cannot fingerprint a object "
        "(tensors, None, bool, int, float, str and bytes only; flatten containers first) (R-HF07)"
    )
    assert [r.getMessage() for r in caplog.records if r.name == _hf_record.__name__] == [said]


def test_digests_every_must_be_a_positive_int(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedOption) as info:
        make_trainer(str(tmp_path), digests_every=0)
    assert str(info.value) == (
        "digests_every=0: a digests row every N optimizer steps needs an int N >= 1, "
        "or None for the default cadence (R-HF08)"
    )


def test_the_audit_stop_request_commits_that_step_and_ends_the_process_with_75(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CKPTKIT_STOP_AT", "3")
    with pytest.raises(RunStopped) as info:
        make_trainer(str(tmp_path), save_steps=100).train()
    assert info.value.code == 75 and info.value.step == 3
    assert sorted(run_checkpoints(tmp_path)) == [3]
    assert [r["step"] for r in _rows(tmp_path, "step")] == [0, 1, 2]
    assert f"ckptkit: stopped at step 3 (CKPTKIT_STOP_AT=3): saved {tmp_path / 'checkpoint-3'}; resume with: " in (
        capsys.readouterr().err
    )


def test_a_resume_after_a_kill_proves_the_steps_it_re_runs(tmp_path: Path) -> None:
    make_trainer(str(tmp_path), save_steps=4, callbacks=[StopAt(6)]).train()  # rows 4 and 5 outlive checkpoint 4
    make_trainer(str(tmp_path), save_steps=4).train(resume_from_checkpoint=True)
    (verdict,) = _rows(tmp_path, "resume_check")
    assert (verdict["verdict"], verdict["from"], verdict["to"]) == ("verified", 4, 5)
    assert [r["step"] for r in _rows(tmp_path, "step")] == list(range(8))


def test_a_resume_that_draws_other_numbers_stops_naming_the_step_and_a_tensor(tmp_path: Path) -> None:
    make_trainer(str(tmp_path), save_steps=4, global_draw_from=0, callbacks=[StopAt(6)]).train()
    with pytest.raises(ReplayDivergence) as info:
        make_trainer(str(tmp_path), save_steps=4, global_draw_from=0).train(resume_from_checkpoint=True)
    assert f"{tmp_path}: the resumed run differs from the interrupted run at step 4: tensor model:model." in str(
        info.value
    )


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


@pytest.mark.slow
def test_the_audit_of_the_example_is_identical_and_its_replay_and_plot_serve_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cmd = [sys.executable, str(EXAMPLE), "--output-dir", "{run_dir}"]
    code, out = _cli(capsys, "audit", "--keep-dir", str(tmp_path / "audit"), "--", *cmd)
    assert code == 0, out
    assert "IDENTICAL: 8 steps, every history fingerprint and 4 checkpoint(s) bit for bit (16 recorded rows)" in out
    a = tmp_path / "audit" / "a"
    code, out = _cli(capsys, "replay", str(a), "--from", "4", "--out", str(tmp_path / "replay"), "--", *cmd)
    assert code == 0, out
    assert "IDENTICAL: steps 4..7" in out
    code, out = _cli(capsys, "plot", str(a), "-o", str(tmp_path / "plot.png"), "--json")
    assert code == 0 and json.loads(out)["series"] == ["grad_norm", "loss", "lr"]


@pytest.mark.slow
def test_the_audit_names_a_tensor_when_the_example_draws_from_the_global_generator_after_a_save(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out = _cli(
        capsys, "audit", "--", sys.executable, str(EXAMPLE), "--output-dir", "{run_dir}", "--global-draw-from", "0"
    )
    assert code == 1, out
    assert "DIFFERS at step 4: the step row" in out
    assert "    model:model.lm_head.weight" in out
