"""torchdata's StatefulDataLoader through ``RunState.add_stateful`` (spec/runstate.md RS-3a,
docs/adopting.md §2).

A plain loop (``for epoch in range(start // len(loader), EPOCHS): for batch in loader``) over
a plain ``StatefulDataLoader(shuffle=True)``, with 0 and 2 workers, with and without a
generator, stopped mid-epoch, at an epoch's end or in a later epoch and resumed across an
epoch boundary, sees the batches an uninterrupted run sees. The two torchdata behaviours
ckptkit makes up for are pinned on their own: a loader restored at an epoch's end yields an
empty first pass, and one restored without workers has its generator one draw behind.
"""

from __future__ import annotations

import dataclasses
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
EPOCHS = 3
STOPS = (2, BATCHES_PER_EPOCH, 2 * BATCHES_PER_EPOCH - 1)  # mid-epoch, an epoch's end, mid a later epoch


@dataclasses.dataclass
class Cfg:
    seed: int = 1000


def _loader(workers: int, generator: bool) -> StatefulDataLoader:
    gen = torch.Generator() if generator else None
    return StatefulDataLoader(list(range(10)), batch_size=3, shuffle=True, generator=gen, num_workers=workers)


def _plain_loop(state: ckptkit.RunState, loader: StatefulDataLoader, start: int, until: int) -> list[list[int]]:
    """The batches of steps ``start..until``, the epoch counted from the step."""
    seen: list[list[int]] = []
    for _epoch in range(start // len(loader), EPOCHS):
        for batch in loader:
            seen.append(batch.tolist())
            state.save(start + len(seen))
            if start + len(seen) == until:
                return seen
    return seen


def _train(run_dir: Path, workers: int, generator: bool, *, seed: int, until: int = 0) -> list[list[int]]:
    """A run's batches from its start (resumed when ``run_dir`` holds a checkpoint) to ``until``."""
    torch.manual_seed(seed)  # without generator=, torchdata seeds its sampler's from the global one
    loader = _loader(workers, generator)
    state = ckptkit.RunState(run_dir, config=Cfg())
    state.add_stateful("loader", loader)
    seen = _plain_loop(state, loader, state.resume_or_start(), until)
    state.close()
    loader.load_state_dict({})  # drops its iterator: its workers stop now, not at a later gc (a 5 s join each)
    return seen


@pytest.mark.parametrize("generator", [True, False], ids=["generator", "no-generator"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_plain_loop_resumed_mid_epoch_or_at_an_epochs_end_sees_the_uninterrupted_batches(
    tmp_path: Path, workers: int, generator: bool
) -> None:
    straight = _train(tmp_path / "straight", workers, generator, seed=0)
    assert len(straight) == EPOCHS * BATCHES_PER_EPOCH
    assert sorted(i for batch in straight[:BATCHES_PER_EPOCH] for i in batch) == list(range(10))  # every sample once
    assert straight[:BATCHES_PER_EPOCH] != straight[BATCHES_PER_EPOCH : 2 * BATCHES_PER_EPOCH]  # reshuffled
    for stop in STOPS:
        first = _train(tmp_path / f"split-{stop}", workers, generator, seed=0, until=stop)
        rest = _train(tmp_path / f"split-{stop}", workers, generator, seed=1)  # another global seed: not used
        assert first + rest == straight, f"stopped at step {stop}"


def _used_up(loader: StatefulDataLoader) -> Any:
    """A loader's iterator after an epoch's last batch: where a loop body saves, before ``StopIteration``."""
    it = iter(loader)
    for _ in range(BATCHES_PER_EPOCH):
        next(it)
    return it


def test_torchdata_restored_at_an_epochs_end_yields_an_empty_first_pass_which_add_stateful_ends(
    tmp_path: Path,
) -> None:
    """Why a restore ends a used-up epoch: ``range(start // len(loader), ...)`` would lose one."""
    loader = _loader(0, True)
    it = _used_up(loader)
    state = ckptkit.RunState(tmp_path, config=Cfg())
    state.add_stateful("loader", loader)
    state.start()
    state.save(BATCHES_PER_EPOCH)
    alone = _loader(0, True)
    alone.load_state_dict(loader.state_dict())
    assert list(alone) == []  # torchdata alone: the restored epoch, used up
    assert len(list(alone)) == BATCHES_PER_EPOCH  # then the next epoch
    again = _loader(0, True)
    fresh = ckptkit.RunState(tmp_path, config=Cfg())
    fresh.add_stateful("loader", again)
    fresh.resume()
    with pytest.raises(StopIteration):
        next(it)  # the uninterrupted loader: its epoch is over too, and its next pass is the next epoch
    assert [b.tolist() for b in again] == [b.tolist() for b in loader]  # through add_stateful: the next epoch at once


def test_torchdata_restored_without_workers_leaves_the_generator_one_draw_behind() -> None:
    """Why the saved state keeps the generator: each epoch's iterator draws the permutation, then
    the workers' base seed; the restore re-draws the permutation only."""
    loader = _loader(0, True)
    it = iter(loader)
    next(it)
    restored = _loader(0, True)
    restored.load_state_dict(loader.state_dict())
    assert len(list(restored)) == len(list(it)) == BATCHES_PER_EPOCH - 1
    behind = restored.generator.get_state()
    assert not torch.equal(behind, loader.generator.get_state())
    torch.empty((), dtype=torch.int64).random_(generator=restored.generator)  # the base seed's draw
    assert torch.equal(restored.generator.get_state(), loader.generator.get_state())


def test_a_state_holding_a_generator_tensor_is_registered_and_comes_back_bitwise(tmp_path: Path) -> None:
    loader = _loader(0, True)
    it = iter(loader)
    next(it)
    held = loader.state_dict()
    gen_state = held["_sampler_iter_state"]["sampler_iter_state"]["generator"]
    assert isinstance(gen_state, torch.Tensor) and gen_state.dtype == torch.uint8
    state = ckptkit.RunState(tmp_path, config=Cfg())
    state.add_stateful("loader", loader)
    state.start()
    state.save(1)
    saved = state.load_checkpoint(1)[0].monitor["values"]["loader"]
    # the generator as it is now, as bytes: a distributed run's plain values carry them too
    assert saved["ckptkit_generators"] == {"generator": loader.generator.get_state().numpy().tobytes()}
    again = _loader(0, True)
    fresh = ckptkit.RunState(tmp_path, config=Cfg())
    fresh.add_stateful("loader", again)
    assert fresh.resume().step == 1
    back = again.state_dict()["_sampler_iter_state"]["sampler_iter_state"]["generator"]
    assert torch.equal(back, gen_state)
    assert torch.equal(again.generator.get_state(), loader.generator.get_state())


@pytest.mark.parametrize("how", ["sampler", "batch_sampler"])
def test_a_loader_shuffled_by_a_torch_sampler_without_state_is_refused_at_registration(
    tmp_path: Path, how: str
) -> None:
    """torchdata resumes a sampler without state by drawing a new order: refused before the run trains."""
    data = list(range(10))
    sampler = torch.utils.data.RandomSampler(data)
    loader = (
        StatefulDataLoader(data, batch_size=3, sampler=sampler)
        if how == "sampler"
        else StatefulDataLoader(data, batch_sampler=torch.utils.data.BatchSampler(sampler, 3, drop_last=False))
    )
    state = ckptkit.RunState(tmp_path, config=Cfg())
    with pytest.raises(ckptkit.UnsupportedValue) as err:
        state.add_stateful("loader", loader)
    assert str(err.value) == (
        "stateful 'loader': its sampler, torch's RandomSampler, keeps no state: torchdata resumes it by drawing a "
        "new order, so a resumed epoch would see other batches (spec/runstate.md RS-3a); build the loader with "
        "shuffle=True (torchdata's own sampler) or give it a sampler with state_dict()/load_state_dict()"
    )


class _Batches:
    """A batch sampler without a length: where its epoch ends is not known before it is drawn past."""

    def __iter__(self) -> Any:
        return iter([[0, 1], [2, 3]])


def test_a_loader_whose_epoch_end_is_unknown_is_restored_as_torchdata_restores_it(tmp_path: Path) -> None:
    loader = StatefulDataLoader(list(range(4)), batch_sampler=_Batches())
    it = iter(loader)
    next(it), next(it)
    state = ckptkit.RunState(tmp_path, config=Cfg())
    state.add_stateful("loader", loader)
    state.start()
    state.save(2)
    again = StatefulDataLoader(list(range(4)), batch_sampler=_Batches())
    fresh = ckptkit.RunState(tmp_path, config=Cfg())
    fresh.add_stateful("loader", again)
    fresh.resume()
    assert list(again) == []  # the used-up epoch, as torchdata restores it (spec/runstate.md RS-3a)
    assert [b.tolist() for b in again] == [[0, 1], [2, 3]]


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
