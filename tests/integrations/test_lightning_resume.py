"""A Lightning resume restores what Lightning leaves out (spec/lightning.md R-L08).

Lightning 2.6 restores neither the global generators (dropout draws from torch's) nor a
plain ``DataLoader``'s position: resumed mid-epoch, it restarts the loader with a new
shuffle. With the plug-in passed as a callback too, a run killed mid-epoch and resumed
equals the uninterrupted run bit for bit, two epochs later, with a plain ``DataLoader`` and
with torchdata's ``StatefulDataLoader``; a loader that cannot be restored is named before
step 1.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from _lightning_worker import every_five
from helpers import same
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler, TensorDataset

import ckptkit
from ckptkit.errors import FormatError
from ckptkit.integrations.lightning import CheckpointIO

pytestmark = [
    pytest.mark.slow,
    # Lightning's advice for real jobs, its note on resuming in the run's own directory, torch's LeafSpec notice.
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec"),
]

_WORKER = str(Path(__file__).resolve().parents[1] / "_lightning_worker.py")


def _worker(*args: object) -> list[str]:
    return [sys.executable, _WORKER, *map(str, args)]


def _kill_after_checkpoint(roots: list[Path]) -> None:
    """Start a run per root (its name is the loader's kind), together; SIGKILL each once its
    ``step=15.ckpt`` is committed and it hangs at step 17, in the middle of epoch 1."""
    procs = [_start(_worker(f"{root}:{root.name}", "--hang-at", 17)) for root in roots]
    deadline = time.monotonic() + 300
    try:
        for root, proc in zip(roots, procs, strict=True):
            while not (root / "hanging").exists():
                assert proc.poll() is None, proc.communicate()[1][-2000:]
                assert time.monotonic() < deadline, "step 17 not reached"
                time.sleep(0.01)
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    for root, proc in zip(roots, procs, strict=True):
        assert proc.returncode == -9 and (root / "step=15.ckpt").exists()


def _start(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_killed_mid_epoch_and_resumed_equals_the_uninterrupted_run_two_epochs_later(tmp_path: Path) -> None:
    """Dropout, numpy and Python draws; 10 batches an epoch; killed in epoch 1 after the step-15
    checkpoint, resumed to step 35 (epoch 3): the weights are bitwise those of the straight run."""
    kinds = ("plain", "stateful")
    _kill_after_checkpoint([tmp_path / "cut" / kind for kind in kinds])
    runs = [f"{tmp_path / 'cut' / kind}:{kind}:15" for kind in kinds]
    runs += [f"{tmp_path / 'straight' / kind}:{kind}" for kind in kinds]
    done = subprocess.run(_worker(*runs), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert done.returncode == 0, done.stderr[-2000:]
    for kind in kinds:
        a, b = (ckptkit.load(tmp_path / run / kind / "final.ckpt") for run in ("straight", "cut"))
        assert a.step == b.step == 35
        assert same(a.model, b.model), kind


# --- in-process: the state kept, an epoch's end, what is named at fit start ----------------------


class Dropping(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = torch.nn.Linear(4, 1), torch.nn.Dropout(0.5)
        self.seen: list[list[int]] = []

    def training_step(self, batch: Any, _i: int) -> torch.Tensor:
        (idx,) = batch["a"] if isinstance(batch, dict) else batch  # a dict from combined loaders
        self.seen.append(idx.tolist())
        x = torch.cos(idx.float()[:, None] * torch.arange(4.0))
        return self.fc(self.drop(x)).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(root: Path, steps: int, loader: Any = None, ckpt_path: Path | None = None) -> tuple[Dropping, Any]:
    torch.manual_seed(0)
    model, trainer = Dropping(), every_five(root, steps)
    if loader is None:
        loader = DataLoader(TensorDataset(torch.arange(20)), batch_size=4, shuffle=True)  # 5 batches an epoch
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return model, trainer


def test_a_run_resumed_from_an_epochs_end_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    straight, _t = _fit(tmp_path / "a", 15)
    _fit(tmp_path / "b", 6)
    state = ckptkit.load(tmp_path / "b" / "step=5.ckpt").monitor["checkpoint"]["callbacks"]["CheckpointIO"]
    assert sorted(state) == ["batches", "rng", "shuffles"] and state["batches"] == 5  # the epoch's last batch
    assert sorted(state["rng"]) == ["numpy", "python", "torch"] and len(state["shuffles"]) == 1
    np.random.seed(9)
    torch.manual_seed(9)  # what a new process would hold
    resumed, _t = _fit(tmp_path / "b", 15, ckpt_path=tmp_path / "b" / "step=5.ckpt")
    assert resumed.seen == straight.seen[5:]
    assert same(dict(straight.state_dict()), dict(resumed.state_dict()))


def test_a_checkpoint_saved_after_an_epochs_last_batch_ended_is_named_at_resume(tmp_path: Path) -> None:
    """Lightning's own quirk (its TorchCheckpointIO too): it resumes such a checkpoint with one more batch,
    then starts the next epoch."""
    _model, trainer = _fit(tmp_path, 5)
    trainer.save_checkpoint(tmp_path / "after.ckpt")
    with pytest.warns(UserWarning, match=r"after\.ckpt: saved after the epoch's last batch had ended \(Model"):
        resumed, _t = _fit(tmp_path, 10, ckpt_path=tmp_path / "after.ckpt")
    assert len(resumed.seen) == 5


class Stream(IterableDataset):
    def __iter__(self) -> Any:
        return iter([(torch.tensor([i, i, i, i]),) for i in range(5)])


def test_a_loader_that_cannot_be_restored_is_named_before_step_1(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"R-L08") as said:
        model, _t = _fit(tmp_path, 1, loader=DataLoader(Stream(), batch_size=None))
    want = (
        "training loader 0 (torch.utils.data.dataloader.DataLoader): a resume from this run's checkpoints will not "
        "read the batches the run would have read: an IterableDataset's position is not saved; use torchdata's "
        "StatefulDataLoader (or give the loader state_dict / load_state_dict) (spec/lightning.md R-L08)"
    )
    assert [str(w.message) for w in said if "R-L08" in str(w.message)] == [want]
    assert len(model.seen) == 1


def test_a_checkpoint_saved_without_the_callback_role_is_named_at_resume(tmp_path: Path) -> None:
    trainer = L.Trainer(
        max_steps=5, plugins=[CheckpointIO()], default_root_dir=tmp_path, logger=False, enable_checkpointing=False
    )
    trainer.fit(Dropping(), DataLoader(TensorDataset(torch.arange(20)), batch_size=4))
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.warns(UserWarning, match=r"plain\.ckpt: holds no resume state of the plug-in \(it was not passed"):
        _fit(tmp_path / "r", 7, ckpt_path=tmp_path / "plain.ckpt")


def test_an_altered_resume_state_is_refused() -> None:
    with pytest.raises(FormatError) as e:
        CheckpointIO().load_state_dict({"rng": {}})
    assert str(e.value) == (
        "callbacks.CheckpointIO: the plug-in's resume state is missing one of rng, batches, shuffles; "
        "the checkpoint was altered after it was written (spec/lightning.md R-L08)"
    )


class Shuffled(Sampler[int]):
    def __iter__(self) -> Any:
        return iter(torch.randperm(20).tolist())


class Pairs(Sampler[list[int]]):
    def __iter__(self) -> Any:
        return iter([[i, i + 1] for i in range(0, 20, 2)])


def _data(**kw: Any) -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.arange(20)), **kw)


@pytest.mark.parametrize(
    ("loader", "why"),
    [
        (
            _data(batch_size=4, shuffle=True, num_workers=2),
            (
                "with num_workers=2 the epoch's order and the workers' seeds are drawn when Lightning starts the "
                "epoch, before a callback can restore them"
            ),
        ),
        (_data(batch_size=4, sampler=Shuffled()), "its sampler, a Shuffled, keeps no state"),
        (_data(batch_sampler=BatchSampler(Shuffled(), 4, drop_last=False)), "its sampler, a Shuffled, keeps no state"),
        (_data(batch_sampler=Pairs()), "its batch_sampler, a Pairs, keeps no state"),
        ([(torch.arange(4),)], "a list keeps no position"),
    ],
)
def test_each_loader_that_cannot_be_restored_is_named_with_why(loader: Any, why: str) -> None:
    from ckptkit.integrations._lightning_resume import _why_not

    assert _why_not(loader) == why


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata's own call
def test_a_plain_loader_combined_with_a_stateful_one_is_named(tmp_path: Path) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    loaders = {"a": _data(batch_size=4), "b": StatefulDataLoader(TensorDataset(torch.arange(20)), batch_size=4)}
    with pytest.warns(UserWarning, match=r"R-L08") as said:
        _fit(tmp_path, 1, loader=loaders)
    assert [str(w.message).split(": ")[:3] for w in said if "R-L08" in str(w.message)] == [
        [
            "training loader 0 (torch.utils.data.dataloader.DataLoader)",
            "a resume from this run's checkpoints will not read the batches the run would have read",
            (
                "it is combined with a stateful loader, which Lightning restores on its own; use torchdata's "
                "StatefulDataLoader (or give the loader state_dict / load_state_dict) (spec/lightning.md R-L08)"
            ),
        ]
    ]
