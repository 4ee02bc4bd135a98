"""What a Lightning resume leaves out, kept by the plug-in's callback role (spec/lightning.md R-L08).

Lightning (2.x) restores the module, the optimizers, its loops and a stateful loader's
``state_dict``. It does not restore the global generators (Python's ``random``, numpy's,
torch's CPU and CUDA ones: dropout and augmentations draw from them), and a plain
``DataLoader`` resumed mid-epoch restarts from its first batch, with a new shuffle drawn
from the global generator, for the epoch's remaining count of batches. The callback role
keeps the rest of the run in ``checkpoint['callbacks']['CheckpointIO']``, plain values only:

* ``rng``: the global generators' states when the checkpoint was taken;
* ``batches``: how many batches the current epoch had taken from the loaders;
* ``shuffles``: per shuffled plain loader (``RandomSampler``, ``num_workers=0``), the state of
  the generator the plug-in gives its sampler at fit start, at the epoch's start and now.

On a resume it sets those generators, takes the batches already trained on from the
restarted loaders, then sets the global generators, when training starts (``on_train_start``,
the first hook at which Lightning's loaders exist, before step 1). A loader whose position
cannot be restored this way is named then, with why.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..errors import FormatError
from ..run._rng import global_rng_state, set_global_rng_state

__all__ = ["ResumeState"]

# The keys of the callback state (spec/lightning.md R-L08).
_KEYS = ("rng", "batches", "shuffles")
_STATEFUL_ADVICE = "use torchdata's StatefulDataLoader (or give the loader state_dict / load_state_dict)"


def _stateful(loader: Any) -> bool:
    """Lightning's own test: a loader with ``state_dict`` and ``load_state_dict`` is restored by Lightning."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def _sampler(loader: Any) -> Any:
    """The sampler that orders the loader's samples: its batch sampler's when it has one."""
    batches = getattr(loader, "batch_sampler", None)
    return getattr(batches, "sampler", None) if batches is not None else getattr(loader, "sampler", None)


def _random_sampler(loader: Any) -> Any:
    """The loader's ``RandomSampler`` (None when it has another sampler)."""
    from torch.utils.data import RandomSampler

    sampler = _sampler(loader)
    return sampler if isinstance(sampler, RandomSampler) else None


def _why_not(loader: Any) -> str | None:
    """Why the position of a plain (not stateful) loader cannot be restored; None when it can."""
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, SequentialSampler

    if not isinstance(loader, DataLoader):
        return f"a {type(loader).__name__} keeps no position"
    if isinstance(loader.dataset, IterableDataset):
        return "an IterableDataset's position is not saved"
    if loader.num_workers > 0:
        return (
            f"with num_workers={loader.num_workers} the epoch's order and the workers' seeds are drawn when Lightning "
            "starts the epoch, before a callback can restore them"
        )
    if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
        return f"its batch_sampler, a {type(loader.batch_sampler).__name__}, keeps no state"
    sampler = _sampler(loader)
    if not isinstance(sampler, (SequentialSampler, DistributedSampler)) and _random_sampler(loader) is None:
        return f"its sampler, a {type(sampler).__name__}, keeps no state"
    return None


def _name(index: int, loader: Any) -> str:
    return f"training loader {index} ({type(loader).__module__}.{type(loader).__qualname__})"


def _generator(sampler: Any) -> Any:
    """A generator of the sampler's own, seeded by one draw of the one it had (the global one when None),
    the draw ``RandomSampler`` makes itself at each epoch's start."""
    import torch

    seed = int(torch.empty((), dtype=torch.int64).random_(generator=sampler.generator).item())
    return torch.Generator().manual_seed(seed)


def _name_an_ended_epoch(trainer: Any) -> None:
    """Name a checkpoint saved after an epoch's last batch had ended, whose resume Lightning gets wrong."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current
    if done.completed == done.ready == trainer.fit_loop.max_batches:
        warnings.warn(
            f"{trainer.ckpt_path}: saved after the epoch's last batch had ended (ModelCheckpoint at an epoch's end, "
            "or trainer.save_checkpoint after fit); Lightning resumes it with one more batch, then starts the next "
            "epoch (with its own CheckpointIO too), so the run will not be the uninterrupted one: resume from a "
            "checkpoint saved during the epoch, e.g. ModelCheckpoint(every_n_train_steps=N) (spec/lightning.md R-L08)",
            UserWarning,
            stacklevel=3,
        )


class ResumeState:
    """The callback role's run state: what it saves with each checkpoint and restores on a resume."""

    def __init__(self) -> None:
        self._trainer: Any = None
        self._loaded: dict[str, Any] | None = None  # a checkpoint's state, until training starts
        self._shuffles: list[Any] = []  # the generators given to shuffled plain loaders' samplers
        self._starts: list[Any] = []  # their states at the current epoch's start

    def setup(self, trainer: Any) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        """The global generators now, the batches the epoch has taken, the shuffles' generators."""
        batches = 0
        if self._trainer is not None:
            batches = int(self._trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        shuffles = [{"start": s, "now": g.get_state()} for g, s in zip(self._shuffles, self._starts, strict=True)]
        return {"rng": global_rng_state(), "batches": batches, "shuffles": shuffles}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep a checkpoint's state until training starts (Lightning loads callbacks before its loaders exist).

        Raises:
            FormatError: the state lacks one of its keys (the file was altered, or written by another tool).
        """
        if not isinstance(state, dict) or any(k not in state for k in _KEYS):
            raise FormatError(
                "the plug-in's resume state is missing one of " + ", ".join(_KEYS),
                field="callbacks.CheckpointIO",
                hint="the checkpoint was altered after it was written (spec/lightning.md R-L08)",
            )
        self._loaded = state

    def on_train_start(self, trainer: Any) -> None:
        """Name the loaders that cannot resume exactly; on a resume, restore what Lightning leaves out."""
        loaders = list(trainer.fit_loop._combined_loader.flattened)  # Lightning 2.x: the training loaders
        plain = [(i, dl) for i, dl in enumerate(loaders) if not _stateful(dl)]
        mixed = bool(plain) and len(plain) < len(loaders)
        for i, dl in plain:
            why = "it is combined with a stateful loader, which Lightning restores on its own" if mixed else None
            why = why or _why_not(dl)
            if why is not None:
                warnings.warn(
                    f"{_name(i, dl)}: a resume from this run's checkpoints will not read the batches the run would "
                    f"have read: {why}; {_STATEFUL_ADVICE} (spec/lightning.md R-L08)",
                    UserWarning,
                    stacklevel=2,
                )
        samplers = [s for _i, dl in plain if (s := _random_sampler(dl)) is not None and _why_not(dl) is None]
        self._shuffles = [_generator(s) for s in samplers]
        for sampler, g in zip(samplers, self._shuffles, strict=True):
            sampler.generator = g
        self._starts = [g.get_state() for g in self._shuffles]
        if self._loaded is not None:
            _name_an_ended_epoch(trainer)
            self._restore(trainer, self._loaded, skip=bool(plain) and not mixed)
            self._loaded = None
        elif trainer.ckpt_path is not None:
            warnings.warn(
                f"{trainer.ckpt_path}: holds no resume state of the plug-in (it was not passed in callbacks when the "
                "checkpoint was saved): the global generators and a plain DataLoader's position are not restored "
                "(spec/lightning.md R-L08)",
                UserWarning,
                stacklevel=2,
            )

    def on_train_epoch_start(self) -> None:
        """An epoch's order is drawn at its first batch, after this hook: keep the shuffles' states here."""
        self._starts = [g.get_state() for g in self._shuffles]

    def _restore(self, trainer: Any, state: dict[str, Any], *, skip: bool) -> None:
        """Set the shuffles' generators, take the batches already trained on, then set the global generators."""
        batches, total = int(state["batches"]), trainer.fit_loop.max_batches
        mid_epoch = 0 < batches < total
        for g, saved in zip(self._shuffles, state["shuffles"], strict=False):
            g.set_state(saved["start"] if mid_epoch else saved["now"])
        self._starts = [saved["start"] for saved in state["shuffles"][: len(self._shuffles)]]
        fetcher = trainer.fit_loop._data_fetcher  # Lightning 2.x: the training batches' iterator
        if skip and mid_epoch:
            # Lightning restarted the loaders; its fetcher counts these batches as taken already.
            for _ in range(batches):
                next(fetcher.iterator)
        set_global_rng_state(state["rng"])
        if skip and not mid_epoch:
            # The next epoch's loaders: started after the checkpoint, as in the run, so that what
            # they draw from the global generators (a DataLoader's base seed) is drawn from it.
            iter(fetcher)
