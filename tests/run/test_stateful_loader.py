"""torchdata's StatefulDataLoader through ``RunState.add_stateful`` (docs/adopting.md §2).

The real loader, shuffling from a generator, with 0 and 2 workers: a run stopped
mid-epoch, or at an epoch's last batch, and resumed from its checkpoint sees the
batches an uninterrupted run sees. The boundary case is where torchdata itself
differs from a plain loop: the first pass over a loader restored from an epoch's end
yields nothing, so the recipe counts epochs as run state (``add_value("epoch")``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit

pytest.importorskip("torchdata")
from torchdata.stateful_dataloader import StatefulDataLoader

# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:.*set_vital:UserWarning")

BATCHES_PER_EPOCH = 4  # 10 samples, batch 3: the last batch is short


@dataclasses.dataclass
class Cfg:
    seed: int = 1000


def _loader(workers: int) -> StatefulDataLoader:
    gen = torch.Generator()
    return StatefulDataLoader(list(range(10)), batch_size=3, shuffle=True, generator=gen, num_workers=workers)


class Feed:
    """The recipe: each epoch's shuffle is a function of (seed, epoch), and the epoch is run state."""

    def __init__(self, loader: StatefulDataLoader, seed: int) -> None:
        self.loader, self.seed, self.epoch = loader, seed, 0

    def batches(self) -> Iterator[list[int]]:
        while True:
            self.loader.generator.manual_seed(self.seed + self.epoch)
            for batch in self.loader:  # a loader restored at an epoch's end yields nothing here
                yield batch.tolist()
            self.epoch += 1

    def register(self, state: ckptkit.RunState) -> None:
        state.add_stateful("loader", self.loader)
        state.add_value("epoch", get=lambda: self.epoch, set=self._set_epoch)

    def _set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def _train(run_dir: Path, workers: int, steps: int, *, until: int | None = None) -> list[list[int]]:
    """Batches seen by steps ``start..until`` of a run (resumed when ``run_dir`` holds a checkpoint)."""
    cfg = Cfg()
    feed = Feed(_loader(workers), cfg.seed)
    state = ckptkit.RunState(run_dir, config=cfg)
    feed.register(state)
    start = state.resume_or_start()
    seen, batches = [], feed.batches()
    for step in range(start, until or steps):
        seen.append(next(batches))
        state.save(step + 1)
    state.close()
    return seen


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop", [2, BATCHES_PER_EPOCH, 2 * BATCHES_PER_EPOCH - 1])
def test_a_resume_mid_epoch_or_at_an_epochs_end_sees_the_uninterrupted_batches(
    tmp_path: Path, workers: int, stop: int
) -> None:
    steps = 3 * BATCHES_PER_EPOCH
    straight = _train(tmp_path / "straight", workers, steps)
    assert sorted(i for batch in straight[:BATCHES_PER_EPOCH] for i in batch) == list(range(10))  # every sample once
    assert straight[:BATCHES_PER_EPOCH] != straight[BATCHES_PER_EPOCH : 2 * BATCHES_PER_EPOCH]  # reshuffled
    first = _train(tmp_path / "split", workers, steps, until=stop)
    assert first + _train(tmp_path / "split", workers, steps) == straight


def test_torchdatas_own_behaviour_at_an_epochs_end_is_an_empty_first_pass(tmp_path: Path) -> None:
    """Why the recipe keeps the epoch: ``for epoch in range(step // len(loader), ...)`` loses one."""
    loader = _loader(0)
    it = iter(loader)
    for _ in range(BATCHES_PER_EPOCH):  # a loop's body saves here: after the last batch, before StopIteration
        next(it)
    at_end = _loader(0)
    at_end.load_state_dict(loader.state_dict())
    assert list(at_end) == []
    assert len(list(at_end)) == BATCHES_PER_EPOCH  # the next pass is the next epoch
    with pytest.raises(StopIteration):
        next(it)  # the uninterrupted loader: its epoch is over too, and its next pass is the next epoch


def test_a_state_holding_a_generator_tensor_is_registered_and_comes_back_bitwise(tmp_path: Path) -> None:
    loader = _loader(0)
    it = iter(loader)
    next(it)
    held = loader.state_dict()
    gen_state = held["_sampler_iter_state"]["sampler_iter_state"]["generator"]
    assert isinstance(gen_state, torch.Tensor) and gen_state.dtype == torch.uint8
    state = ckptkit.RunState(tmp_path, config=Cfg())
    state.add_stateful("loader", loader)
    state.start()
    state.save(1)
    again = _loader(0)
    fresh = ckptkit.RunState(tmp_path, config=Cfg())
    fresh.add_stateful("loader", again)
    assert fresh.resume().step == 1
    back = again.state_dict()["_sampler_iter_state"]["sampler_iter_state"]["generator"]
    assert torch.equal(back, gen_state)


class _Holder:
    def __init__(self, tree: Any) -> None:
        self.tree = tree

    def state_dict(self) -> Any:
        return self.tree

    def load_state_dict(self, tree: Any) -> None:
        self.tree = tree


def test_add_value_refuses_a_tensor_with_a_message_that_does_not_contradict_itself(tmp_path: Path) -> None:
    state = ckptkit.RunState(tmp_path, config=Cfg())
    with pytest.raises(ckptkit.UnsupportedValue) as err:
        state.add_value("g", get=lambda: {"generator": torch.zeros(3, dtype=torch.uint8)}, set=lambda _v: None)
    assert str(err.value) == (
        "value 'g'['generator']: a torch.Tensor cannot be stored here: this is a plain value (None, bool, int, "
        "float, str, bytes, lists, tuples, dicts, sets, numpy arrays and scalars), which holds no tensors; store "
        "value.tolist(), or register the object whose state it is with add_stateful"
    )
    state.add_stateful("g", _Holder({"generator": torch.zeros(3, dtype=torch.uint8), "n": 2}))
    with pytest.raises(ckptkit.UnsupportedValue, match=r"stateful 'h'\['p'\]: a pathlib.PosixPath cannot be stored"):
        state.add_stateful("h", _Holder({"p": Path("x")}))
