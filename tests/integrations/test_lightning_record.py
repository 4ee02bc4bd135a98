"""A Lightning run recorded, audited and self-checked (spec/lightning.md R-L09..R-L11).

The real Lightning ``Trainer`` on the tiny network of ``examples/lightning_finetune.py`` (CPU,
dropout, a shuffled ``DataLoader``). In-process where the behaviour is the recording's;
``ckptkit audit`` runs the example as the user would, each run a process of its own.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from ckptkit import Checkpoint, ReplayDivergence, UnsupportedOption
from ckptkit.audit._recording import checkpoint_difference
from ckptkit.cli import main
from ckptkit.format._checkpoint import load, save
from ckptkit.integrations import _lightning_record, _run_record
from ckptkit.integrations.lightning import CheckpointIO
from ckptkit.run import checkpoint_digests, float_bits, read_rows
from ckptkit.run._files import run_checkpoints
from ckptkit.testing import assert_command_resumes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lightning_finetune.py"
sys.path.insert(0, str(EXAMPLE.parent))
from lightning_finetune import Net, loader, make_trainer  # noqa: E402

pytestmark = [
    # Lightning's advice for real jobs, its note on resuming in the run's own directory, torch's LeafSpec notice.
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec"),
    pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended"),
]


class Losses(Net):
    """The example's network, keeping each loss ``training_step`` returned."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach().clone())
        return loss


class StopAt(Callback):
    """Ends training after step ``n``, as a kill there would (nothing saved at ``n``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.n:
            trainer.should_stop = True


def _fit(
    run_dir: Path, steps: int, *, ckpt: str | None = None, extra: Any = (), accumulate: int = 1, **kwargs: Any
) -> Any:
    torch.manual_seed(0)
    model = Losses()
    trainer = make_trainer(str(run_dir), steps=steps, **kwargs)
    trainer.callbacks.extend(extra)
    trainer.accumulate_grad_batches = accumulate
    trainer.fit(model, loader(), ckpt_path=ckpt)
    return model


def _rows(out: Path, kind: str) -> list[dict[str, Any]]:
    return [r for r in read_rows(out / "history.jsonl")[0] if r["kind"] == kind]


def test_each_step_row_holds_the_loss_training_step_returned_and_the_lr_bit_for_bit(tmp_path: Path) -> None:
    model = _fit(tmp_path, 7)
    steps = _rows(tmp_path, "step")
    assert [r["step"] for r in steps] == list(range(7))
    assert [r["loss_bits"] for r in steps] == [float_bits(loss) for loss in model.losses]
    assert [r["lr"] for r in steps] == [0.05] * 5 + [0.025] * 2  # StepLR(step_size=5): the lr the step used
    digests = _rows(tmp_path, "digests")
    assert [r["step"] for r in digests] == list(range(1, 8))  # the default: every step, the state is small
    ckpt = load(tmp_path / "step-00000006.ckpt")  # the digests row names the file's state as the file does
    saved = checkpoint_digests(Checkpoint(step=6, model=ckpt.model, optim=ckpt.optim))
    assert "optim:optimizer_states.0.state.0.momentum_buffer" in saved
    assert digests[5]["tensors"] == saved
    assert {"torch", "lightning"} <= set(json.loads((tmp_path / "environment.json").read_text()))


def test_with_gradient_accumulation_a_step_row_sums_its_batches_losses_as_lightning_scales_them(
    tmp_path: Path,
) -> None:
    model = _fit(tmp_path, 3, accumulate=2)
    steps = _rows(tmp_path, "step")
    assert [r["step"] for r in steps] == [0, 1, 2] and len(model.losses) == 6
    halves = [model.losses[2 * i] / 2 + model.losses[2 * i + 1] / 2 for i in range(3)]
    assert [r["loss_bits"] for r in steps] == [float_bits(loss) for loss in halves]


def test_digests_every_sets_the_cadence_and_a_large_state_is_digested_at_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fit(tmp_path / "two", 5, digests_every=2)
    assert [r["step"] for r in _rows(tmp_path / "two", "digests")] == [2, 4]
    with pytest.raises(UnsupportedOption) as info:
        CheckpointIO(digests_every=0)
    assert str(info.value) == (
        "digests_every=0: a digests row every N optimizer steps needs an int N >= 1, "
        "or None for the default cadence (spec/lightning.md R-L10)"
    )
    monkeypatch.setattr(_run_record, "SMALL_STATE", 0)
    _fit(tmp_path / "large", 7)
    assert [r["step"] for r in _rows(tmp_path / "large", "digests")] == sorted(run_checkpoints(tmp_path / "large"))
    assert sorted(run_checkpoints(tmp_path / "large")) == [3, 6]


def test_a_resume_proves_the_steps_it_re_runs_and_a_global_draw_stops_it_naming_a_tensor(tmp_path: Path) -> None:
    _fit(tmp_path / "ok", 8, extra=[StopAt(5)])  # rows 3 and 4 outlive checkpoint 3
    _fit(tmp_path / "ok", 8, ckpt=str(tmp_path / "ok" / "step-00000003.ckpt"))
    (verdict,) = _rows(tmp_path / "ok", "resume_check")
    assert (verdict["verdict"], verdict["from"], verdict["to"]) == ("verified", 3, 4)
    assert [r["step"] for r in _rows(tmp_path / "ok", "step")] == list(range(8))
    _fit(tmp_path / "draw", 8, extra=[StopAt(5)], global_draw_from=0)
    with pytest.raises(ReplayDivergence) as info:
        _fit(tmp_path / "draw", 8, ckpt=str(tmp_path / "draw" / "step-00000003.ckpt"), global_draw_from=0)
    assert f"{tmp_path / 'draw'}: the resumed run differs from the interrupted run at step 3: tensor model:" in str(
        info.value
    )


def test_a_batch_without_a_digest_leaves_the_data_field_out_said_once_and_record_false_writes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rec = _lightning_record.Recorder(None, None)
    row: dict[str, Any] = {}
    for _ in range(2):
        rec.batches = [{"ids": object()}]
        rec._add_data(row)
    assert row == {}
    said = (
        "history.jsonl: step rows record no data digest: data.0.ids: cannot fingerprint a object "
        "(tensors, None, bool, int, float, str and bytes only; flatten containers first) (spec/lightning.md R-L09)"
    )
    assert [r.getMessage() for r in caplog.records if r.name == _lightning_record.__name__] == [said]
    _fit(tmp_path, 3, record=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003.ckpt"]


def test_two_checkpoints_that_differ_only_in_naming_their_own_run_directory_are_the_same(tmp_path: Path) -> None:
    def write(run: Path, other: str) -> str:
        monitor = {"dirpath": str(run), "best": str(run / "step-00000003.ckpt"), "other": other}
        run.mkdir()
        save(run / "step-00000003.ckpt", Checkpoint(step=3, monitor=monitor))
        return str(run / "step-00000003.ckpt")

    a, b = write(tmp_path / "a", "x"), write(tmp_path / "b", "x")
    assert checkpoint_difference(3, a, b) is None
    d = checkpoint_difference(3, a, write(tmp_path / "c", str(tmp_path / "a")))  # another run's folder differs
    assert d is not None and [t.name for t in d.tensors] == ["monitor:other"]


@pytest.mark.slow
def test_the_audit_of_the_example_is_identical_and_names_a_tensor_of_a_planted_global_draw(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cmd = ["audit", "--", sys.executable, str(EXAMPLE), "--run-dir", "{run_dir}"]
    code = main(cmd)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "IDENTICAL: 24 steps, every history fingerprint and 8 checkpoint(s) bit for bit (48 recorded rows)" in out
    code = main([*cmd, "--global-draw-from", "0"])
    out = capsys.readouterr().out
    assert code == 1, out
    # b is SIGKILLed once a checkpoint at or after 12 is committed: its resume re-runs from 12 or later.
    assert re.search(r"^DIFFERS at step (12|15|18|21): the step row", out, re.M), out
    assert "    model:state_dict.net.0.weight" in out


@pytest.mark.slow
def test_the_example_sigkilled_mid_epoch_resumes_as_the_uninterrupted_run_across_an_epoch_boundary() -> None:
    """spec/replay.md R-P19 on a Lightning script: killed as its history reaches step 7 (past checkpoint 6),
    resumed in epoch 0, which ends at step 10."""
    assert_command_resumes([sys.executable, str(EXAMPLE), "--run-dir", "{run_dir}"], [7])
