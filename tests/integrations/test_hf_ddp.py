"""The Hugging Face ``Trainer`` integration on 2 gloo ranks (spec/transformers.md R-HF11).

One DDP job of the example's tiny GPT-2 (tests/_hf_ddp_worker.py: each rank draws its own dropout
masks) runs under real ``torchrun`` three times through :func:`ckptkit.testing.assert_command_resumes`:
straight to step 8, and SIGKILLed -- the whole job, every rank -- once its history reaches step 5, as
the save of ``checkpoint-6/`` begins, then started again with the same command. The resumed job's
rows and checkpoints equal the straight one's bit for bit. ``accelerate launch`` runs the same job
and resumes a checkpoint ``torchrun`` wrote to the same weights. The module's processes take about
a minute together, most of it importing transformers four times on two ranks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import same

from ckptkit import LeaseLost, UnsupportedValue, WorldSizeChanged
from ckptkit.audit._trainer_folder import folder_state
from ckptkit.cli import main
from ckptkit.format._checkpoint import load
from ckptkit.integrations.hf_folder import LAYOUT, STATE_FILE, check_folder
from ckptkit.run import read_rows
from ckptkit.testing import assert_command_resumes

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "_hf_ddp_worker.py")
RANK_FILE = "ckptkit-rng-1.ckpt"
sys.path.insert(0, str(ROOT / "examples"))
from hf_finetune import make_trainer  # noqa: E402


def _job(launcher: list[str], out: str) -> list[str]:
    return [sys.executable, "-m", *launcher, WORKER, "--output-dir", out]


TORCHRUN = ["torch.distributed.run", "--nproc-per-node", "2"]
# --multi_gpu is accelerate's torchrun route; on a machine without a GPU the example's use_cpu=True
# makes it 2 gloo ranks. (--cpu --num_processes 2 starts one process here: multi-CPU needs mpirun.)
ACCELERATE = ["accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
ACCELERATE += ["--mixed_precision", "no", "--dynamo_backend", "no"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``a``: the job straight to step 8; ``b``: killed at step 5 and resumed to 8 (checked equal)."""
    work = tmp_path_factory.mktemp("hf-ddp")
    assert_command_resumes(_job(TORCHRUN, "{run_dir}"), [5], workdir=work, timeout=300)
    return work


def test_a_two_rank_ddp_fine_tune_killed_and_resumed_equals_the_uninterrupted_one_bitwise(runs: Path) -> None:
    a, b = runs / "a" / "checkpoint-8", runs / "b" / "checkpoint-8"
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert same(folder_state(str(a)), folder_state(str(b)))
    # each rank's own RNG states are kept, and they differ (the worker seeds each rank apart)
    rank0, rank1 = load(str(a / STATE_FILE)).monitor, load(str(a / RANK_FILE)).monitor
    assert (rank0["layout"], rank0["world_size"], rank1["layout"], rank1["rank"]) == (LAYOUT, 2, LAYOUT, 1)
    assert not same(rank0["rng"]["torch"], rank1["rng"]["torch"])
    assert RANK_FILE in check_folder(str(a)).files  # bound by the commit's record, as every file
    # rank 0 alone writes the history: one row per step
    assert [r["step"] for r in read_rows(runs / "a" / "history.jsonl")[0] if r["kind"] == "step"] == list(range(8))
    assert main(["verify", str(runs / "b")]) == 0


def test_accelerate_launch_resumes_a_checkpoint_torchrun_wrote_to_the_same_weights(runs: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(runs / "a", out)
    for step in (6, 8):
        shutil.rmtree(out / f"checkpoint-{step}")
    proc = subprocess.run(_job(ACCELERATE, str(out)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert same(folder_state(str(out / "checkpoint-8")), folder_state(str(runs / "a" / "checkpoint-8")))
    verdicts = [r for r in read_rows(out / "history.jsonl")[0] if r["kind"] == "resume_check"]
    assert [v["verdict"] for v in verdicts] == ["verified"], verdicts


def test_a_two_rank_checkpoint_is_refused_by_one_process_naming_both_world_sizes(runs: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(runs / "a", out)
    trainer = make_trainer(str(out), args={"full_determinism": False})
    with pytest.raises(WorldSizeChanged) as e:
        trainer.train(resume_from_checkpoint=True)
    assert str(e.value) == (
        f"{out / 'checkpoint-8'}: saved by 2 process(es), resumed by 1; each rank's RNG states and its share of "
        "the data continue the same run only at the world size it was saved at: start the job with 2 "
        "process(es) (torchrun --nproc-per-node 2), or begin a new run (R-HF11)"
    )


def test_fsdp_and_deepspeed_are_refused_naming_what_is_covered(tmp_path: Path, monkeypatch: Any) -> None:
    import transformers

    def fsdp(self: Any) -> None:
        real(self)
        self.is_fsdp_enabled = True  # accelerate enables FSDP on GPUs only; its flag as it would be there

    real = transformers.Trainer.create_accelerator_and_postprocess
    monkeypatch.setattr(transformers.Trainer, "create_accelerator_and_postprocess", fsdp)
    with pytest.raises(UnsupportedValue) as e:
        make_trainer(str(tmp_path), args={"full_determinism": False})
    assert str(e.value) == (
        "ckptkit.integrations.transformers covers one process and DDP (torchrun or accelerate launch), not FSDP "
        "(R-HF11): train without it, or save the run with ckptkit.RunState and a DCP store (ckptkit.distributed)"
    )


def test_a_rank_whose_torchrun_agent_is_gone_stops_before_writing(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # as torchrun starts a rank: its parent is the agent
    trainer = make_trainer(str(tmp_path), args={"full_determinism": False})
    agent = os.getppid()
    monkeypatch.setattr(os, "getppid", lambda: 1)  # the agent died: the rank was re-parented
    with pytest.raises(LeaseLost) as e:
        trainer.train()
    assert str(e.value) == (
        f"{tmp_path / 'checkpoint-2'}: this rank's launcher (pid {agent}) is gone: rank 0 stops before saving, "
        "without writing (R-HF11)"
    )
    assert not (tmp_path / "checkpoint-2").exists()
