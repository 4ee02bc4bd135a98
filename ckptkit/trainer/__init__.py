"""The reference trainer: a tiny byte-level GPT, and the first user of :class:`~ckptkit.run.state.RunState`.

    ckptkit train --run-dir runs/a --steps 200
    ckptkit train --run-dir runs/a --steps 400 --resume
    torchrun --nproc_per_node 2 -m ckptkit train --run-dir runs/d --steps 40 --ckpt-every 10

Modules: ``config`` (the plan: every knob a config key), ``data`` (the byte
stream and its offset rule), ``model`` (GPT, int8 fake quant, EMA teacher),
``ngram`` (the bigram table kept in the ``.ngram`` sidecar), ``history``
(``history.jsonl``), ``loop`` (the training loop: ``train``, ``train_step``), ``parallel``
(the loop under torchrun: DDP / FSDP2, each rank's rows, the reductions), ``audit`` and
``replay`` (the one audit and replay engine run on ``ckptkit train``, with the trainer's
hooks). The format library never imports
this package. ``spec/trainer.md`` is the contract for its files.
"""

from __future__ import annotations

from ..run.history import compared_rows, read_rows
from .config import DataConfig, ModelConfig, TestingAids, TrainConfig, TrainerConfig
from .loop import StepResult, TrainResult, train, train_step

__all__ = [
    "DataConfig",
    "ModelConfig",
    "StepResult",
    "TestingAids",
    "TrainConfig",
    "TrainResult",
    "TrainerConfig",
    "compared_rows",
    "read_rows",
    "train",
    "train_step",
]
