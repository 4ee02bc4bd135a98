"""Starting and resuming a run, once for every store: rank 0 chooses, every rank checks.

A resume (spec/runstate.md RS-2, RS-D6):

1. **choose** (rank 0): sweep what an interrupted save left, then take the newest
   checkpoint the store finds consistent — every byte, its snapshot, sidecars and
   companion record; each one passed over is said, with why (damage, never drift);
2. **check** (every rank, agreed): the world it was saved at, the config snapshot
   (:func:`~ckptkit.run.check_resume`), the environment, a legacy container's
   gaps, and the fit to what is registered — before anything is restored;
3. **load**: the store puts the tensors into destinations shaped like the live ones;
4. **retention** (rank 0): what a process stopped before its retention left beyond ``keep``
   is removed, and that is said (spec/lease.md R-LS17).

A refusal on any rank is raised on every rank. Nothing is restored until every check
has passed.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, LegacyCheckpoint
from ..format._checkpoint import Checkpoint
from ..format._companions import UNBOUND_NOTE
from ._drift import KeyDiff, check_resume
from ._environment import EnvDiff, capture, check_environment
from ._files import (
    fallback_notes,
    is_damage,
    newest_consistent,
    refuse_existing,
    sweep_note,
)
from ._group import Group, world_of
from ._registry import Registry
from ._store import Opened, Sidecars, Store

__all__ = ["ResumeInfo", "has_checkpoints", "resume", "resume_row", "start"]


@dataclass(frozen=True)
class ResumeInfo:
    """What :meth:`RunState.resume` did.

    Attributes:
        step: the step training continues from.
        path: the checkpoint it came from.
        notes: human lines worth logging (fallbacks, exempt changes, overrides).
        skipped: ``(path, reason)`` for each newer checkpoint that was passed over.
        exempt_changes: config differences that were allowed (``steps`` extended...).
        env_overrides: environment differences accepted with ``allow_env_change``.
        legacy_missing: for a v1 checkpoint loaded with ``allow_legacy``, what it lacked.
        resharded: a distributed run resumed with ``reshard=True`` at another world size
            or layout than it was saved at; ``notes`` say the run is no longer bit-comparable
            to its past (record that in the run's history).
    """

    step: int
    path: str
    notes: tuple[str, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()
    exempt_changes: tuple[KeyDiff, ...] = ()
    env_overrides: tuple[EnvDiff, ...] = ()
    legacy_missing: tuple[str, ...] = ()
    resharded: bool = False


@dataclass(frozen=True)
class Resume:
    """How a run asks to be resumed (``RunState.resume``'s options and the run's config)."""

    config: Any
    exempt: frozenset[str]
    allow_legacy: bool = False
    allow_env_change: bool = False
    reshard: bool = False


def resume_row(info: ResumeInfo, *, allow_legacy: bool, allow_env_change: bool, notes: Sequence[str]) -> dict[str, Any]:
    """The history's ``resume`` row for ``info`` (spec/trainer.md): where the process began, from
    which checkpoint, what it allowed and overrode. ``env_diffs`` is the environment this process
    runs under, by fact against ``environment.json`` (R-D12): ``ckptkit audit`` reports it."""
    return {
        "kind": "resume",
        "step": info.step,
        "checkpoint": os.path.basename(info.path),
        "allow_legacy": allow_legacy,
        "legacy_missing": list(info.legacy_missing),
        "allow_env_change": allow_env_change,
        "env_overrides": [str(d) for d in info.env_overrides],
        "env_diffs": [d.to_json() for d in info.env_overrides],
        "resharded": info.resharded,
        "notes": list(notes),
        "time": time.time(),
    }


def start(store: Store, group: Group, run_dir: str, log: Callable[[str], None]) -> int:
    """Begin a fresh run: rank 0 removes what interrupted saves left (saying so), refuses a used
    directory, else records the environment (with the world it runs at); returns step 0.

    Raises:
        ResumeRefused: the run directory already holds checkpoints.
        WorldSizeChanged: it holds the other store's checkpoints.
    """

    def rank0() -> list[str]:
        store.refuse_foreign()
        notes = sweep_note(store.sweep())  # R-O36
        refuse_existing(run_dir, store.listing())
        record = {**capture(), **store.facts()}
        store.begin((json.dumps(record, sort_keys=True, indent=2) + "\n").encode())
        return notes

    for note in group.from_rank0(rank0, "starting the run"):
        log(note)
    return 0


def has_checkpoints(group: Group, store: Store) -> bool:
    """Rank 0 looks: does the run directory hold a checkpoint of any store (``resume_or_start``)?
    What an interrupted save left is none (R-023)."""
    return group.from_rank0(store.any_checkpoints, "listing checkpoints")


def resume(
    store: Store,
    group: Group,
    reg: Registry,
    run_dir: str,
    how: Resume,
    restore: Callable[[Checkpoint, Sidecars], None],
    log: Callable[[str], None],
) -> ResumeInfo:
    """Choose, check, load and ``restore`` (the module docstring's steps), then log the notes.

    Raises:
        As :meth:`ckptkit.RunState.resume`, on every rank.
    """
    store.wait()
    passed: list[tuple[str, str]] = []  # damaged, found so while loading (R-O36)
    while True:
        path, notes, skipped = group.from_rank0(lambda: _choose(store, run_dir, passed), "choosing the checkpoint")
        checked = group.agree(functools.partial(_check, store, reg, run_dir, path, how), "checking the checkpoint")
        opened, exempt, env, legacy = checked
        try:
            ckpt = store.load(path, opened)
            break
        except CheckpointError as e:
            if opened.checked_whole or not is_damage(e):
                raise
            passed.append((path, str(e)))  # raised on every rank, nothing restored (R-O36)
    notes = [*notes, *(d.describe() for d in exempt), *(f"environment override: {d}" for d in env)]
    if legacy:
        notes.append(f"LEGACY checkpoint {os.path.basename(path)}: proceeding without {', '.join(legacy)}")
    notes += opened.notes
    restore(ckpt, opened.sidecars)
    notes += group.from_rank0(lambda: _finish_retention(store, path, log), "finishing retention")
    for n in notes:
        log(n)
    return ResumeInfo(
        ckpt.step, path, tuple(notes), tuple(skipped), tuple(exempt), tuple(env), legacy, opened.resharded
    )


def _choose(store: Store, run_dir: str, passed: list[tuple[str, str]]) -> tuple[str, list[str], list[tuple[str, str]]]:
    """Rank 0: the newest consistent checkpoint but those ``passed`` over already, ``(path, why)``;
    every fallback said."""
    store.refuse_foreign()
    notes = sweep_note(store.sweep())
    gone = {p for p, _why in passed}
    (step, record), path, skipped = newest_consistent(
        run_dir, [(s, p) for s, p in store.listing() if p not in gone], lambda step, p: (step, store.check(step, p))
    )
    skipped = [*passed, *skipped]
    notes += fallback_notes(skipped, path, step)
    if record is None:
        notes.append(f"{os.path.basename(path)} {UNBOUND_NOTE}")
    return path, notes, skipped


def _finish_retention(store: Store, path: str, log: Callable[[str], None]) -> list[str]:
    """Rank 0, the resume's checks passed: the retention an earlier process did not do (it stopped
    between its last commit and its retention). Of the checkpoints up to the one resumed, all but
    the newest ``keep`` are removed, and one line says so (spec/lease.md R-LS17); a newer one it
    passed over is left to the next save's retention. A failure to remove is said, and retried then.
    """
    listed = [p for _s, p in store.listing()]
    extra = listed[: listed.index(path) + 1][: -store.keep] if path in listed else []
    gone = []
    for p in extra:
        try:
            store.delete(p)
            gone.append(os.path.basename(p))
        except (CheckpointError, OSError) as e:
            log(f"retention: cannot delete {p} ({e}); will retry at the next save")
    if not gone:
        return []
    why = "the process that saved them stopped before its retention, or kept more"
    return [f"retention finished: removed {', '.join(gone)}, beyond keep={store.keep} ({why})"]


def _check(
    store: Store, reg: Registry, run_dir: str, path: str, how: Resume
) -> tuple[Opened, list[KeyDiff], list[EnvDiff], tuple[str, ...]]:
    """Every rank: world, config, environment, legacy and registrations, before anything is loaded."""
    opened = store.open(path, reshard=how.reshard)
    exempt = check_resume(store.snapshot(path), how.config, exempt=how.exempt)
    recorded = store.environment()
    world = world_of(recorded)
    env = check_environment(
        {k: v for k, v in recorded.items() if k not in world}, capture(), allow=how.allow_env_change
    )
    legacy = _check_legacy(opened.ckpt, path, reg, how.allow_legacy)
    reg.check_contents(opened.ckpt, path)
    return opened, exempt, env, legacy


def _check_legacy(ckpt: Checkpoint, path: str, reg: Registry, allow: bool) -> tuple[str, ...]:
    """What a v1 checkpoint cannot carry, refused unless ``allow``."""
    if not ckpt.legacy:
        return ()
    needed = [m for m in ckpt.missing if m != "flags" or reg.flags]
    needed = [m for m in needed if m != "teacher" or reg.teacher is not None]
    needed = [m for m in needed if m != "monitor" or reg.monitor_registered()]
    missing = tuple(needed)
    if not allow:
        raise LegacyCheckpoint(
            f"{path}: is a legacy v1 checkpoint; it cannot carry: {', '.join(ckpt.missing)}"
            f"{' (this run needs ' + ', '.join(missing) + ')' if missing else ''}; "
            "pass --allow-legacy (allow_legacy=True) to continue without them",
            ckpt.missing,
        )
    return ckpt.missing
