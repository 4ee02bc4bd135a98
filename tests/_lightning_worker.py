"""Lightning runs in their own process, for tests/integrations/test_lightning_resume.py.

    python tests/_lightning_worker.py DIR:KIND[:RESUME] ... [--hang-at STEP]

Per run, in turn, the script a user writes: ``seed_everything(0)``, a tiny module with
``nn.Dropout`` and draws from numpy's and Python's global generators, ``deterministic=True``,
CPU, the plug-in as plug-in and callback, ``ModelCheckpoint`` every 5 steps in DIR, 10 batches
an epoch, 35 optimizer steps. KIND ``plain`` is ``DataLoader(shuffle=True)``, ``stateful``
torchdata's ``StatefulDataLoader(shuffle=True)``. RESUME ``S`` resumes from ``DIR/step=S.ckpt``.
``--hang-at S`` writes ``DIR/hanging`` at step S and sleeps there, for the test to SIGKILL.
The final weights go to ``DIR/final.ckpt`` (``ckptkit.save``). Its own process:
``deterministic=True`` switches torch's global flags. The test's in-process runs build their
trainer with :func:`every_five` too.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import ckptkit
from ckptkit.integrations.lightning import CheckpointIO

STEPS = 35


class Net(L.LightningModule):
    """Dropout and global numpy / Python draws: every global generator reaches the weights."""

    def __init__(self, hang_at: int | None, marker: Path) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1)
        self.hang_at, self.marker = hang_at, marker

    def training_step(self, batch: Any, _i: int) -> torch.Tensor:
        if self.global_step == self.hang_at:
            self.marker.touch()
            time.sleep(600)
        (idx,) = batch
        scale = float(np.random.rand()) + random.random()
        x = torch.sin(idx.float()[:, None] * torch.arange(8.0)) * scale
        y = x.sum(dim=1, keepdim=True)
        return torch.nn.functional.mse_loss(self.fc2(self.drop(torch.tanh(self.fc1(x)))), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def every_five(root: Path, steps: int, **kw: Any) -> L.Trainer:
    """A CPU trainer, quiet, with the plug-in as plug-in and callback and a checkpoint every 5 steps in ``root``."""
    io = CheckpointIO()
    every5 = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=5, save_top_k=-1)
    return L.Trainer(
        max_steps=steps,
        plugins=[io],
        callbacks=[io, every5],
        default_root_dir=root,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def run(root: Path, kind: str, resume: int | None, hang_at: int | None) -> None:
    L.seed_everything(0, verbose=False)
    model = Net(hang_at, root / "hanging")
    data = TensorDataset(torch.arange(40))
    loader = (StatefulDataLoader if kind == "stateful" else DataLoader)(data, batch_size=4, shuffle=True)
    trainer = every_five(root, STEPS, deterministic=True)
    trainer.fit(model, loader, ckpt_path=None if resume is None else str(root / f"step={resume}.ckpt"))
    ckptkit.save(root / "final.ckpt", ckptkit.Checkpoint(step=trainer.global_step, model=dict(model.state_dict())))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", help="DIR:KIND[:RESUME]")
    parser.add_argument("--hang-at", type=int)
    args = parser.parse_args()
    for spec in args.runs:
        where, kind, *resume = spec.split(":")
        run(Path(where), kind, int(resume[0]) if resume else None, args.hang_at)


if __name__ == "__main__":
    main()
