"""A folder transformers' own ``Trainer`` wrote, imported once into a ckptkit run (docs/integrations.md).

The real ``transformers.Trainer`` trains the tiny GPT-2 of tests/_hf_worker.py to step 20
in its own process and writes its pickled ``checkpoint-20/``. Here, a plain loop imports
that folder (``import_trainer_folder``: safetensors and weights-only loads, no pickle),
continues it under ``RunState`` — ``resume_or_start`` starts the run, the import sets its
state, ``save(20)`` writes the run's first checkpoint — is stopped at 27 and resumed in
fresh objects by the same ``resume_or_start``: at step 30 it equals a loop that ran 20..30
without a stop, bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from _hf_worker import tiny_gpt2
from helpers import same

import ckptkit
from ckptkit.integrations.hf_import import import_trainer_folder

pytestmark = pytest.mark.slow

_WORKER = str(Path(__file__).resolve().parents[1].joinpath("_hf_worker.py"))
_ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``checkpoint-20/`` of transformers' own Trainer (stopped at 20 of 40)."""
    out = tmp_path_factory.mktemp("plain") / "out"
    env = {**os.environ, "PYTHONPATH": _ROOT, "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, _WORKER, str(out), "--plain", "--stop", "20"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out / "checkpoint-20"


@dataclasses.dataclass
class Cfg:
    seed: int = 1  # the dropout draws of step k come from (seed, k)


@dataclasses.dataclass
class Loop:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    state: ckptkit.RunState


def _loop(run_dir: Path, folder: Path) -> tuple[Loop, int]:
    """The user's loop: its objects built as the Trainer built them, registered, then resume or import."""
    model = tiny_gpt2()
    # the Trainer's two parameter groups (the method uses no state of its Trainer)
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n in decay]}, {"params": [p for n, p in named if n not in decay]}]
    opt = torch.optim.AdamW(groups, lr=0.01)
    sched = transformers.get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=40)
    state = ckptkit.RunState(run_dir, config=Cfg(), keep=10)
    state.add_model("model", model)
    state.add_optimizer("adamw", opt)
    state.add_scheduler("lr", sched)
    step = state.resume_or_start()
    if step == 0:  # a new run: it begins where the Trainer's folder ended
        old = import_trainer_folder(folder)
        missing = model.load_state_dict(old.model, strict=False).missing_keys
        assert missing == ["lm_head.weight"]  # tied to the input embedding: stored once
        assert old.optimizer is not None and old.scheduler is not None
        opt.load_state_dict(old.optimizer)
        sched.load_state_dict(old.scheduler)
        step = old.step
        state.save(step)  # the run's first checkpoint: snapshot, environment, companions
    return Loop(model, opt, sched, state), step


def _train(loop: Loop, start: int, until: int) -> None:
    loop.model.train()  # dropout on: each step's draws come from (seed, step)
    for step in range(start, until):
        ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(step))
        with ckptkit.step_rng(Cfg.seed, step):
            loss = loop.model(input_ids=ids, labels=ids).loss
        loss.backward()
        loop.opt.step()
        loop.sched.step()
        loop.opt.zero_grad(set_to_none=True)
        if (step + 1) % 5 == 0:
            loop.state.save(step + 1)
    loop.state.close()


def _tripwire(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Count every unpickling entry point (pickle's and torch.load) from here on."""
    calls: list[str] = []

    def counting(name: str, real: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            calls.append(name)
            return real(*a, **k)

        return call

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, counting(f"pickle.{name}", getattr(pickle, name)))
    monkeypatch.setattr(torch, "load", counting("torch.load", torch.load))
    return calls


def test_a_trainer_folder_is_imported_started_stopped_and_resumed_to_the_uninterrupted_state(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    straight, start = _loop(tmp_path / "straight", folder)
    assert start == 20
    _train(straight, start, 30)

    first, start = _loop(tmp_path / "run", folder)
    _train(first, start, 27)  # stopped after 27: steps 26, 27 are lost, as in a crash
    assert [s for s, _ in first.state.checkpoints()] == [20, 25]
    calls = _tripwire(monkeypatch)
    again, start = _loop(tmp_path / "run", folder)  # the same call: now a resume, the import not repeated
    assert start == 25 and calls == []
    _train(again, start, 30)
    same(straight.model.state_dict(), again.model.state_dict())
    same(straight.opt.state_dict(), again.opt.state_dict())


def test_the_import_reads_no_pickle_and_says_which_files_it_left(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _tripwire(monkeypatch)
    old = import_trainer_folder(folder)
    assert calls == ["torch.load", "torch.load"]  # optimizer.pt, scheduler.pt: weights_only=True, in ckptkit
    assert old.step == 20 and old.scaler is None and old.optimizer is not None
    assert old.trainer_state["global_step"] == 20
    assert old.not_imported == {
        "rng_state.pth": "a pickle of Python and numpy RNG objects; the new run seeds its own RNG",
        "training_args.bin": "a pickled TrainingArguments; give the new run its config (RunState(config=...))",
    }


def test_the_refusal_of_a_pickled_file_is_plain_text(folder: Path) -> None:
    with pytest.raises(ckptkit.UnsupportedValue) as e:
        ckptkit.import_torch_checkpoint(folder / "rng_state.pth")
    assert str(e.value) == (
        f"{folder / 'rng_state.pth'}: torch.load(weights_only=True) refused it (Unsupported global: GLOBAL "
        "numpy._core.multiarray._reconstruct was not an allowed global by default.); only tensors and plain "
        "containers are imported, never arbitrary pickle"
    )
    assert "\x1b" not in str(e.value)


def test_a_ckptkit_save_file_in_the_run_directory_says_why_it_cannot_be_resumed(tmp_path: Path) -> None:
    """The old snippet's trap: ``ckptkit.save`` into the run directory, then ``resume_or_start`` there."""
    ckptkit.save(tmp_path / "step-00000020.ckpt", ckptkit.Checkpoint(step=20, model={"m": {"w": torch.ones(2)}}))
    state = ckptkit.RunState(tmp_path, config=Cfg())
    state.add_model("m", torch.nn.Linear(1, 2, bias=False))
    with pytest.raises(ckptkit.CheckpointNotFound) as e:
        state.resume_or_start()
    assert str(e.value).endswith(
        "step-00000020.ckpt records no companions: a file written by ckptkit.save, not RunState.save, has no config "
        "or environment to resume; move it out of the run directory, load it into the registered objects and let "
        "state.save(step) write the run's first checkpoint (docs/adopting.md section 5))"
    )


def test_a_folder_ckptkits_trainer_committed_or_without_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "checkpoint-5").mkdir()
    (tmp_path / "checkpoint-5" / "ckptkit-state.ckpt").write_bytes(b"")
    with pytest.raises(ckptkit.UnsupportedValue, match=r"committed by ckptkit's Trainer .*resume it with"):
        import_trainer_folder(tmp_path / "checkpoint-5")
    (tmp_path / "checkpoint-6").mkdir()
    (tmp_path / "checkpoint-6" / "trainer_state.json").write_text('{"global_step": 6}')
    with pytest.raises(ckptkit.CheckpointNotFound, match=r"checkpoint-6: no model\.safetensors and no "):
        import_trainer_folder(tmp_path / "checkpoint-6")
