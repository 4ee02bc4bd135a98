"""The reference trainer: a tiny byte-level GPT, and the first user of :class:`~ckptkit.RunState`.

    ckptkit train --run-dir runs/a --steps 200
    ckptkit train --run-dir runs/a --steps 400 --resume
    torchrun --nproc_per_node 2 -m ckptkit train --run-dir runs/d --steps 40 --ckpt-every 10

Its rooms, private behind this face: ``_config`` (the plan: every knob a config key),
``_data`` (the byte stream and its offset rule), ``_model`` (GPT, int8 fake quant, EMA
teacher), ``_ngram`` (the bigram table kept in the ``.ngram`` sidecar), ``_digests`` (what a
step row fingerprints), ``_loop`` (the training loop: ``train``, ``train_step``),
``_parallel`` (the loop under torchrun: DDP / FSDP2, each rank's rows, the reductions),
``_audit`` and ``_replay`` (the one audit and replay engine run on ``ckptkit train``, with
the trainer's hooks). The library never imports this package. ``spec/trainer.md`` is the
contract for its files.
"""

from __future__ import annotations

from ._config import DataConfig, ModelConfig, TestingAids, TrainConfig, TrainerConfig
from ._loop import StepResult, TrainResult, train, train_step

__all__ = [
    "DataConfig",
    "ModelConfig",
    "StepResult",
    "TestingAids",
    "TrainConfig",
    "TrainResult",
    "TrainerConfig",
    "train",
    "train_step",
]
