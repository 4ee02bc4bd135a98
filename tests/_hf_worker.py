"""One Hugging Face ``Trainer`` run in its own process, for tests/integrations/test_transformers.py.

    python tests/_hf_worker.py OUT [--stop 25] [--resume] [--ga 2] [--lr 0.02] [--seed 2] [--save-steps 5]
        [--save-only-model] [--scheduler-kwargs '{"a.b": 1}'] [--plain] [--resume-from PATH]
        [--then-resume same|pretrained ...]

A tiny GPT-2 built from a config (no download, ~4k parameters, dropout on, so the RNG
matters), 48 sequences of 8 tokens, ``full_determinism``, CPU, 40 optimizer steps with a
checkpoint every 10. ``--stop N`` ends the process after step N (the checkpoint at 20 is
committed, steps 21..N are lost as in a crash); ``--resume`` calls
``train(resume_from_checkpoint=True)`` with a pickle trip-wire around it. Writes
``OUT/result.json``: the folder resumed from and the pickle calls counted; a ckptkit
error is printed as ``TYPE: message`` and exits 3. ``--plain`` trains with transformers' own
``Trainer`` (its pickled ``checkpoint-N/`` folders: what a user imports into ckptkit).
``--resume-from PATH`` resumes from the folder named. Each ``--then-resume`` builds a new
``Trainer`` with the same arguments after the first ``train()`` returns and resumes the newest
checkpoint that ``train()`` left, to step 20: on the first Trainer's model object (``same``), or on a model
built with ``from_pretrained`` from that checkpoint (``pretrained``); ``resumed_from`` is then
the list of their folders.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
from typing import Any

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from ckptkit.errors import CheckpointError
from ckptkit.integrations.hf_folder import newest_intact
from ckptkit.integrations.transformers import Trainer


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """48 sequences of 8 token ids (384 tokens), the labels the inputs (a causal LM shifts them)."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 32, (48, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StopAt(TrainerCallback):
    """End training after optimizer step ``n``, as a process that dies there would."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.n:
            control.should_training_stop = True


def tiny_gpt2() -> GPT2LMHeadModel:
    """~4k parameters, dropout on; its weights drawn from seed 0."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2))


def trainer(out: str, opts: argparse.Namespace, model: Any = None, stop: int = 0) -> transformers.Trainer:
    model = tiny_gpt2() if model is None else model
    args = TrainingArguments(
        out,
        max_steps=40,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=opts.ga,
        learning_rate=opts.lr,
        seed=opts.seed,
        full_determinism=True,
        save_steps=opts.save_steps,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        log_level="error",
        save_only_model=opts.save_only_model,
        lr_scheduler_kwargs=json.loads(opts.scheduler_kwargs),
    )
    callbacks: list[TrainerCallback] = [StopAt(stop)] if stop else []
    cls = transformers.Trainer if opts.plain else Trainer
    return cls(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)


def tripwire(calls: list[str]) -> None:
    """Count every unpickling: pickle's own entry points and torch.load (whose weights-only
    unpickler is not pickle.Unpickler)."""

    def counting(name: str, real: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            calls.append(name)
            return real(*a, **kw)

        return call

    class CountingUnpickler(pickle.Unpickler):
        def __init__(self, *a: Any, **kw: Any) -> None:
            calls.append("pickle.Unpickler")
            super().__init__(*a, **kw)

    pickle.load = counting("pickle.load", pickle.load)
    pickle.loads = counting("pickle.loads", pickle.loads)
    pickle.Unpickler = CountingUnpickler  # type: ignore[misc]
    torch.load = counting("torch.load", torch.load)


def resume_again(first: Any, folder: str, opts: argparse.Namespace, how: str) -> str | None:
    """A new Trainer with the same arguments resumes ``folder`` and stops after step 20; its model is the
    first Trainer's model object (``same``) or one built by ``from_pretrained`` from ``folder`` (``pretrained``)."""
    model = GPT2LMHeadModel.from_pretrained(folder) if how == "pretrained" else first.model
    t = trainer(opts.out, opts, model=model, stop=20)
    t.train(resume_from_checkpoint=folder)
    return getattr(t, "resumed_from", None)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--stop", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--ga", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--save-only-model", action="store_true")
    p.add_argument("--scheduler-kwargs", default="{}", help="lr_scheduler_kwargs, as JSON")
    p.add_argument("--plain", action="store_true", help="transformers' own Trainer, not ckptkit's")
    p.add_argument("--resume-from", default=None, help="resume_from_checkpoint: this folder")
    p.add_argument("--then-resume", action="append", choices=["same", "pretrained"], default=[])
    opts = p.parse_args()
    calls: list[str] = []
    try:
        t = trainer(opts.out, opts, stop=opts.stop)
        if opts.resume:
            tripwire(calls)
        t.train(resume_from_checkpoint=opts.resume_from or (True if opts.resume else None))
        folder = newest_intact(opts.out)[0] if opts.then_resume else None
        resumed = [resume_again(t, str(folder), opts, how) for how in opts.then_resume]
    except CheckpointError as e:
        print(f"{type(e).__name__}: {e}")
        return 3
    result = {"pickle_calls": calls, "resumed_from": resumed or getattr(t, "resumed_from", None)}
    with open(os.path.join(opts.out, "result.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
