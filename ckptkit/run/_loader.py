"""torchdata's ``StatefulDataLoader`` given to ``add_stateful``: a resume puts it where the
uninterrupted loader was (spec/runstate.md RS-3a).

torchdata's own ``state_dict()`` resumes a shuffled epoch mid-way. Measured with torchdata
0.11 (``tests/run/test_stateful_loader.py``), a plain loop over the restored loader
(``for epoch in range(start // len(loader), epochs): for batch in loader``) still parts
from the uninterrupted one in two ways:

- With ``num_workers=0`` and ``generator=``, the generator comes back one draw behind:
  each epoch's iterator draws its permutation and then the workers' base seed from it;
  the restore re-draws the permutation from the state saved at the epoch's start, but not
  the seed, so every later epoch shuffles differently. (With workers the iterator
  re-draws the permutation after the seed, so nothing is lost.)
- Saved after an epoch's last batch (in the loop body, before ``StopIteration``), the
  restored loader's first pass yields nothing, and the loop trains one epoch short.

So the saved state also holds the loader's generators as they were at the save (as
bytes: plain values, which a distributed run's replicated state can carry), and a restore
builds the restored iterator at once (the draws it makes happen then), ends an epoch it
finds used up, and puts the generators back: the next ``iter(loader)`` is the pass the
uninterrupted loop's next one would be. What cannot be made exact is refused when it is
registered: a sampler of torch's that keeps no state, which torchdata resumes by drawing
a new order. The torchdata and torch internals read here are in :func:`_end_a_used_up_epoch`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import UnsupportedValue
from ._registry import has_state_dict

__all__ = ["StatefulLoader", "is_stateful_loader"]

#: the key of the generators' states in a saved loader state (torchdata's own keys begin with ``_``)
GENERATORS = "ckptkit_generators"


def is_stateful_loader(obj: Any) -> bool:
    """torchdata's ``StatefulDataLoader`` or a subclass, known by class (torchdata is optional)."""
    return any(c.__name__ == "StatefulDataLoader" and c.__module__.startswith("torchdata.") for c in type(obj).__mro__)


class StatefulLoader:
    """What ``add_stateful`` saves and restores of a ``StatefulDataLoader``.

    Raises:
        UnsupportedValue: the loader's order comes from a torch sampler that keeps no state.
    """

    def __init__(self, name: str, loader: Any) -> None:
        _refuse_a_stateless_shuffle(name, loader)
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        """The loader's state and its generators' (read after it: a first ``state_dict`` draws)."""
        state = dict(self.loader.state_dict())
        state[GENERATORS] = {role: gen.get_state().numpy().tobytes() for role, gen in _generators(self.loader).items()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        import torch

        state = dict(state)
        saved = state.pop(GENERATORS, {})
        self.loader.load_state_dict(state)
        _end_a_used_up_epoch(self.loader)
        for role, gen in _generators(self.loader).items():
            if role in saved:
                gen.set_state(torch.frombuffer(bytearray(saved[role]), dtype=torch.uint8))


def _generators(loader: Any) -> dict[str, Any]:
    """The loader's generator and its sampler's, by role; the sampler's when it is another
    object (``shuffle=True`` without ``generator=``: torchdata seeds one for the sampler)."""
    import torch

    found: dict[str, Any] = {}
    own = getattr(loader, "generator", None)
    if isinstance(own, torch.Generator):
        found["generator"] = own
    drawn = getattr(getattr(loader, "sampler", None), "generator", None)
    if isinstance(drawn, torch.Generator) and drawn is not own:
        found["sampler.generator"] = drawn
    return found


def _end_a_used_up_epoch(loader: Any) -> None:
    """Build the restored iterator now, and mark it finished if its epoch is used up.

    torchdata builds it when asked for its state and hands that iterator to the next
    ``iter(loader)``. One that has yielded all ``len(loader)`` batches of a map-style
    dataset is finished, as the uninterrupted one is by the ``StopIteration`` that ends
    its ``for``; ``iter`` then starts the next epoch. Reads torch's ``DataLoader._iterator``
    and ``_num_yielded`` and sets torchdata's ``_finished`` (as torchdata 0.11 has them). The end
    of an iterable dataset, or of a batch sampler without a length, is not known before it
    is drawn past, and is left as torchdata restores it.
    """
    from torch.utils.data import IterableDataset

    loader.state_dict()
    it = loader._iterator
    if isinstance(loader.dataset, IterableDataset) or it._finished:
        return
    try:
        batches = len(loader)
    except TypeError:
        return
    if it._num_yielded >= batches:
        it._finished = True


def _refuse_a_stateless_shuffle(name: str, loader: Any) -> None:
    from torch.utils.data import RandomSampler, SubsetRandomSampler, WeightedRandomSampler

    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if isinstance(sampler, RandomSampler | SubsetRandomSampler | WeightedRandomSampler) and not has_state_dict(
            sampler
        ):
            raise UnsupportedValue(
                f"stateful {name!r}: its sampler, torch's {type(sampler).__name__}, keeps no state: torchdata "
                "resumes it by drawing a new order, so a resumed epoch would see other batches (spec/runstate.md "
                "RS-3a); build the loader with shuffle=True (torchdata's own sampler) or give it a sampler with "
                "state_dict()/load_state_dict()"
            )
