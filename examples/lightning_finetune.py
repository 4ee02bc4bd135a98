"""A Lightning run with ckptkit: committed checkpoints, exact resumes, a recorded run, an audit.

    python examples/lightning_finetune.py --run-dir runs/pl          # starts, or resumes the newest checkpoint
    ckptkit audit -- python examples/lightning_finetune.py --run-dir {run_dir}
    ckptkit replay runs/pl --from 9 -- python examples/lightning_finetune.py --run-dir {run_dir}
    ckptkit plot runs/pl

A tiny regression network with dropout (so the RNG matters), a shuffled ``DataLoader``, CPU,
a few seconds; 24 optimizer steps over two epochs. Lines marked ``# ckptkit`` are what was
added to a plain Lightning script: the plug-in as plug-in and callback (committed, verified
checkpoints; the state Lightning's resume leaves out; ``RUN_DIR/history.jsonl``: every
optimizer step's loss and learning rate bit for bit and the digest of the weights and
optimizer state, spec/lightning.md R-L09), checkpoints named ``step-N.ckpt`` in the run
directory, and resume-or-start, so the same command continues a stopped run.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from ckptkit.integrations.lightning import CheckpointIO  # ckptkit
from ckptkit.run import list_checkpoints  # ckptkit


class Net(pl.LightningModule):
    """Linear, dropout, linear; SGD with a step-decayed learning rate."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class SampleOnSave(Callback):
    """TESTING AID (``--global-draw-from S``): from step S on, draw from torch's global generator
    when a checkpoint is saved, as a callback that samples from the model on save does. The
    checkpoint holds the generator as it was before the draw, so a process that resumes from
    it draws other dropout masks than the uninterrupted run: not resumable, and the audit says so."""

    def __init__(self, start: int) -> None:
        self.start = start

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if trainer.global_step >= self.start:
            torch.rand(16)


def loader() -> torch.utils.data.DataLoader[Any]:
    """40 samples of 8 features, batches of 4, shuffled: 10 optimizer steps an epoch."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)


def make_trainer(
    run_dir: str, *, steps: int = 24, save_every: int = 3, global_draw_from: int | None = None, **options: Any
) -> Any:
    """The Trainer: the plug-in (``options`` to it: ``digests_every=``...) in plugins and callbacks,
    a checkpoint every ``save_every`` steps."""
    io = CheckpointIO(**options)  # ckptkit
    saves = ModelCheckpoint(
        dirpath=run_dir,
        filename="step-{step:08d}",  # ckptkit: the run directory's names, found by audit and replay
        auto_insert_metric_name=False,
        every_n_train_steps=save_every,
        save_top_k=-1,
    )
    callbacks: list[Any] = [io, saves]  # ckptkit: io in callbacks too
    if global_draw_from is not None:
        callbacks.append(SampleOnSave(global_draw_from))
    return pl.Trainer(
        max_steps=steps,
        plugins=[io],  # ckptkit
        callbacks=callbacks,
        deterministic=True,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=run_dir,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=24, help="optimizer steps")
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--global-draw-from", type=int, default=None, help="TESTING AID: see SampleOnSave")
    o = p.parse_args()
    pl.seed_everything(0, verbose=False)  # seed before the model is built: its initial weights are drawn here
    model = Net()
    trainer = make_trainer(o.run_dir, steps=o.steps, save_every=o.save_every, global_draw_from=o.global_draw_from)
    saved = list_checkpoints(o.run_dir)  # ckptkit: resume the newest checkpoint, or start
    trainer.fit(model, loader(), ckpt_path=saved[-1][1] if saved else None)


if __name__ == "__main__":
    main()
