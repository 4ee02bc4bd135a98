"""A torchtitan run recorded, audited and self-checked (spec/torchtitan.md R-TT11..R-TT13).

torchtitan's components and ``Trainer.train``'s loop from ``examples/torchtitan_cpu.py`` (its llama3
debug model, smaller, FSDP2 on the CPU). In this process on one gloo rank where the behaviour is the
recording's; ``ckptkit audit`` and ``assert_command_resumes`` run the example as the user would, on
2 gloo ranks, each run a process of its own.
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ckptkit.distributed as ckd
from ckptkit import ReplayDivergence, RunStopped, UnsupportedOption
from ckptkit.audit._recording import checkpoint_difference
from ckptkit.cli import main
from ckptkit.integrations import _run_record
from ckptkit.integrations.torchtitan import CheckpointManager
from ckptkit.run import float_bits, read_rows
from ckptkit.run._files import run_checkpoints
from ckptkit.testing import assert_command_resumes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "torchtitan_cpu.py"
sys.path.insert(0, str(EXAMPLE.parent))
import torchtitan_cpu  # noqa: E402

with warnings.catch_warnings():  # its models import torch._inductor, whose import warns: torch's, not ours
    warnings.simplefilter("ignore", DeprecationWarning)
    import torchtitan.models.llama3.config_registry  # noqa: F401

pytestmark = [
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),  # torchdata's, not ours
    pytest.mark.filterwarnings("ignore:To get the last learning rate computed by the scheduler"),  # torch's
]


@pytest.fixture(scope="module", autouse=True)
def _one_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A gloo group of one rank in this process: the example's FSDP2 mesh needs one."""
    init = tmp_path_factory.mktemp("gloo") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Scalars:
    """Keeps what the loop hands the manager each step (``record_step``)."""

    def __init__(self, manager: Any) -> None:
        self.kept: list[dict[str, Any]] = []
        real = manager.record_step

        def record_step(**scalars: Any) -> None:
            self.kept.append(scalars)
            real(**scalars)

        manager.record_step = record_step


def _train(run: Path, steps: int = 4, *, global_draw: bool = False, **options: Any) -> Scalars:
    """The example's loop on one rank, its checkpoints and history in ``run`` (``options``: the
    manager's recording options)."""
    config = torchtitan_cpu.job_config(str(run), steps, folder=".")
    config.checkpoint = CheckpointManager.Config(
        enable=True, folder=".", interval=2, last_save_model_only=False, **options
    )
    parts = torchtitan_cpu.build(config, 0, 1)
    kept = Scalars(parts["checkpointer"])
    try:
        torchtitan_cpu.train(parts, global_draw=global_draw)
    finally:
        parts["checkpointer"].close()
    return kept


def _rows(run: Path, kind: str) -> list[dict[str, Any]]:
    return [r for r in read_rows(run / "history.jsonl")[0] if r["kind"] == kind]


def test_each_step_row_holds_the_loop_s_loss_and_grad_norm_bit_for_bit_and_the_state_s_digests(
    tmp_path: Path,
) -> None:
    kept = _train(tmp_path)
    steps = _rows(tmp_path, "step")
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    assert [r["loss_bits"] for r in steps] == [float_bits(k["loss"]) for k in kept.kept]
    assert [r["grad_norm_bits"] for r in steps] == [float_bits(k["grad_norm"]) for k in kept.kept]
    assert all(r["data"].startswith("0x") for r in steps)
    digests = _rows(tmp_path, "digests")
    assert [r["step"] for r in digests] == [1, 2, 3, 4]  # the default: every step, the state is small
    names = digests[0]["tensors"]
    assert {"model:tok_embeddings.weight", "optim:lr_scheduler.last_epoch", "monitor:train_state.step"} <= set(names)
    assert any(n.startswith("optim:optimizer.state.") for n in names)
    assert sorted(run_checkpoints(tmp_path)) == [2, 4]  # torchtitan's step-N/, found by audit and replay
    assert {"torch", "torchtitan"} <= set(json.loads((tmp_path / "environment.json").read_text()))


def test_digests_every_sets_the_cadence_and_a_large_state_is_digested_at_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _train(tmp_path / "three", digests_every=3)
    assert [r["step"] for r in _rows(tmp_path / "three", "digests")] == [3]
    monkeypatch.setattr(_run_record, "SMALL_STATE", 0)
    _train(tmp_path / "large")
    assert [r["step"] for r in _rows(tmp_path / "large", "digests")] == [2, 4]
    with pytest.raises(UnsupportedOption) as info:
        CheckpointManager.Config(enable=True, digests_every=0)
    assert str(info.value) == (
        "digests_every=0: a digests row every N optimizer steps needs an int N >= 1, "
        "or None for the default cadence (spec/torchtitan.md R-TT12)"
    )


def test_record_false_writes_no_history(tmp_path: Path) -> None:
    _train(tmp_path, record=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-4"]


def test_the_stop_request_commits_that_step_and_ends_the_process_with_75(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPTKIT_STOP_AT", "3")  # not a checkpoint step of interval 2
    with pytest.raises(RunStopped) as info:
        _train(tmp_path)
    assert (info.value.code, info.value.step, info.value.reason) == (75, 3, "CKPTKIT_STOP_AT=3")
    assert sorted(run_checkpoints(tmp_path)) == [2, 3]
    assert [r["step"] for r in _rows(tmp_path, "step")] == [0, 1, 2]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # under torchrun, which reports exit 75 as a failure
    _train(tmp_path / "torchrun")
    assert sorted(run_checkpoints(tmp_path / "torchrun")) == [2, 4]


def test_two_checkpoints_that_differ_only_in_naming_their_own_run_directory_are_the_same(tmp_path: Path) -> None:
    def write(run: Path, other: str) -> str:
        job = {"dump_folder": str(run), "nested": [str(run / "tb")], "other": other}
        ckd.save({"w": torch.ones(2), "ckptkit_job_config": (job,)}, run / "step-2")
        return str(run / "step-2")

    a, b = write(tmp_path / "a", "x"), write(tmp_path / "b", "x")
    assert checkpoint_difference(2, a, b) is None
    d = checkpoint_difference(2, a, write(tmp_path / "c", str(tmp_path / "a")))  # another run's folder differs
    assert d is not None and [t.name for t in d.tensors] == ["ckptkit_job_config"]
    (tmp_path / "c" / "step-3").mkdir()  # a save killed before it committed: no checkpoint
    assert sorted(run_checkpoints(tmp_path / "c")) == [2]


def test_a_resume_proves_the_steps_it_re_runs_and_a_global_draw_stops_it_naming_a_tensor(tmp_path: Path) -> None:
    _train(tmp_path / "ok")
    shutil.rmtree(tmp_path / "ok" / "step-4")  # as if killed in step 4's save: rows 2 and 3 outlive checkpoint 2
    _train(tmp_path / "ok")
    (verdict,) = _rows(tmp_path / "ok", "resume_check")
    assert (verdict["verdict"], verdict["from"], verdict["to"]) == ("verified", 2, 3)
    assert [r["step"] for r in _rows(tmp_path / "ok", "step")] == [0, 1, 2, 3]
    _train(tmp_path / "draw", global_draw=True)
    shutil.rmtree(tmp_path / "draw" / "step-4")
    with pytest.raises(ReplayDivergence) as info:
        _train(tmp_path / "draw", global_draw=True)
    said = f"{tmp_path / 'draw'}: the resumed run differs from the interrupted run at step 2: "
    assert said + "tensor model:layers.0.attention.qkv_linear.wk.weight" in str(info.value), str(info.value)


@pytest.mark.slow
def test_the_audit_of_the_example_is_identical(capsys: pytest.CaptureFixture[str]) -> None:
    # A planted global draw is caught by the resume itself, naming a tensor of torchtitan's
    # checkpoint (test_a_resume_proves_the_steps_it_re_runs_..., test_two_checkpoints_...), and an
    # audit whose resumed run stops so is reported the same way for every trainer (tests/audit, the
    # Lightning and Hugging Face audits): each torchtitan process takes 7 s to import it, so the
    # audit of the planted draw is not run a second time here.
    cmd = ["audit", "--", sys.executable, str(EXAMPLE), "--dump-folder", "{run_dir}", "--checkpoint-folder", "."]
    code = main([*cmd, "--steps", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "b: cooperative stop at step 2, resumed in a fresh process" in out
    assert "IDENTICAL: 4 steps, every history fingerprint and 2 checkpoint(s) bit for bit" in out


@pytest.mark.slow
def test_the_example_sigkilled_in_a_step_resumes_as_the_uninterrupted_run() -> None:
    """spec/replay.md R-P19 on torchtitan's loop: both ranks killed as rank 0's history reaches step 3
    (past checkpoint 2), resumed by the same command."""
    cmd = [sys.executable, str(EXAMPLE), "--dump-folder", "{run_dir}", "--checkpoint-folder", ".", "--steps", "4"]
    assert_command_resumes(cmd, [3])
