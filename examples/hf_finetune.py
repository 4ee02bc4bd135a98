"""A Hugging Face ``Trainer`` fine-tune with ckptkit: committed checkpoints, a recorded run, an audit.

    python examples/hf_finetune.py --output-dir runs/hf            # starts, or resumes the newest checkpoint
    ckptkit audit -- python examples/hf_finetune.py --output-dir {run_dir}
    ckptkit replay runs/hf --from 4 -- python examples/hf_finetune.py --output-dir {run_dir}
    ckptkit plot runs/hf
    torchrun --nproc-per-node 2 examples/hf_finetune.py --output-dir runs/hf-ddp   # DDP, 2 gloo ranks on CPU
    accelerate launch --multi_gpu --num_processes 2 examples/hf_finetune.py --output-dir runs/hf-ddp

A tiny GPT-2 built from a config (no download; dropout on, so the RNG matters), random
token sequences, CPU, a few seconds. Lines marked ``# ckptkit`` are what was added to a
plain fine-tune: ckptkit's ``Trainer`` (committed, verified checkpoints and
``OUTPUT_DIR/history.jsonl``: every optimizer step's loss, gradient norm and learning rate
bit for bit and the digest of the weights and optimizer state, spec/transformers.md R-HF07)
and resume-or-start, so the same command continues a stopped run (``ckptkit audit`` relies on it).
Under ``torchrun`` or ``accelerate launch`` it is a DDP job with nothing changed (``use_cpu=True``:
gloo; spec/transformers.md R-HF11): each rank's RNG states are kept, rank 0 commits each folder.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, NoReturn

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from ckptkit.integrations.hf_folder import newest_intact  # ckptkit
from ckptkit.integrations.transformers import Trainer  # ckptkit: instead of transformers.Trainer


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """64 sequences of 8 token ids, the labels the inputs (a causal LM shifts them)."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 32, (64, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class SampleOnSave(TrainerCallback):
    """TESTING AID (``--global-draw-from S``): from step S on, draw from torch's global generator
    after each checkpoint, as a callback that samples text from the model on save does. The
    checkpoint holds the generator as it was before the draw, so a process that resumes from
    it draws other dropout masks than the uninterrupted run: not resumable, and the audit says so."""

    def __init__(self, start: int) -> None:
        self.start = start

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step >= self.start:
            torch.rand(16)


def make_trainer(
    output_dir: str,
    *,
    steps: int = 8,
    save_steps: int = 2,
    seed: int = 1,
    global_draw_from: int | None = None,
    size: tuple[int, int] = (16, 1),
    args: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Trainer:
    """The fine-tune's Trainer: a GPT-2 of ``size`` = (width, layers), ``args`` over the
    TrainingArguments below, ``kwargs`` to the Trainer (``digests_every=``, ``callbacks=``...)."""
    torch.manual_seed(seed)  # seed before the model is built: its initial weights are drawn here
    width, layers = size
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=width, n_layer=layers, n_head=2))
    training = TrainingArguments(
        output_dir,
        **{
            "max_steps": steps,
            "per_device_train_batch_size": 4,
            "learning_rate": 1e-2,
            "seed": seed,
            "full_determinism": True,
            "save_steps": save_steps,
            "logging_steps": save_steps,  # divides save_steps: the logged loss is exact across a resume
            "report_to": "none",
            "use_cpu": True,
            "disable_tqdm": True,
            "log_level": "error",
            **(args or {}),
        },
    )
    if global_draw_from is not None:
        kwargs["callbacks"] = [*kwargs.get("callbacks", []), SampleOnSave(global_draw_from)]
    return Trainer(model=model, args=training, train_dataset=Tokens(), **kwargs)


def train(trainer: Trainer, output_dir: str) -> None:
    """Resume the newest intact checkpoint in ``output_dir`` (the trainer's), or start, then leave
    the process group."""
    folder, _torn = newest_intact(output_dir)  # ckptkit: a folder a kill cut off mid-save is not one
    try:
        trainer.train(resume_from_checkpoint=folder)  # ckptkit: resume it, or start
    finally:
        if torch.distributed.is_initialized():  # under torchrun / accelerate launch: Trainer leaves it up
            torch.distributed.destroy_process_group()


def leave() -> NoReturn:
    """Exit 0 without the interpreter's shutdown, once everything is written.

    A gloo worker thread may still be releasing the last collective's tensors when the interpreter
    shuts down. That needs the GIL, and taking it during the shutdown aborts the finished process
    ("terminate called without an active exception", exit -6: torch 2.13), which the launcher then
    reports as the whole job failing. Seen about once in 20 resumed 2-rank runs on a loaded machine.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps")
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--global-draw-from", type=int, default=None, help="TESTING AID: see SampleOnSave")
    o = p.parse_args()
    trainer = make_trainer(
        o.output_dir, steps=o.steps, save_steps=o.save_steps, seed=o.seed, global_draw_from=o.global_draw_from
    )
    train(trainer, o.output_dir)
    leave()


if __name__ == "__main__":
    main()
