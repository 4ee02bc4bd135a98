"""A run state across a process group: what :class:`~ckptkit.runstate.RunState` does in a distributed job.

Private: a RunState given ``process_group=``, or built inside an initialised
``torch.distributed`` job, hands its saves, resumes and run-directory work to a
:class:`DistributedRun` (spec/runstate.md "Distributed run state", rules RS-D1..RS-D9).

Every operation here is collective: each rank of the group calls it, in the same
order. What one rank decides (rank 0 chooses the checkpoint, writes the companions
and ``environment.json``, applies retention) is broadcast; what every rank checks
is agreed on before anything is loaded or written, so a refusal is raised on every
rank, never on one while the others wait in a collective.

A checkpoint is a :mod:`ckptkit.distributed` directory ``step-NNNNNNNN.dcp/``
holding this DCP state dict::

    model.<name>.<fqn>     torch.distributed.checkpoint.state_dict's get_model_state_dict
                           (DDP: no "module."; FSDP2: each rank's shards)
    teacher.<fqn>          the teacher, likewise
    optim.<name>.<...>     get_optimizer_state_dict (parameters by name)
    run                    rank 0's replicated state as one plain value: step, flags,
                           schedulers, scalers, monitors, values, the registered
                           names and the companion record
    ranks.<r>              rank r's own state as one plain value: data positions and
                           per-rank values, under a key no other rank writes, so that
                           DCP never takes it for replicated state and keeps one copy

torch is imported lazily: ``import ckptkit`` stays torch-free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from . import _run_files as files
from ._registry import Access
from ._ring import clone, tree_digest
from .atomic import clean_stale_temps, fsync_dir, write_bytes_atomic
from .checkpoint import Checkpoint
from .companions import ENVIRONMENT_FILE, UNBOUND_NOTE, check_companions, record_of
from .drift import check_resume
from .environment import capture, check_environment
from .errors import (
    CheckpointError,
    CheckpointNotFound,
    DistributedFailure,
    FormatError,
    MalformedIndex,
    ReplicaDivergence,
    ResumeRefused,
    WorldSizeChanged,
)
from .sidecar import read_sidecar, sidecar_path
from .snapshot import encode_snapshot, read_snapshot, snapshot_path

if TYPE_CHECKING:
    from .runstate import ResumeInfo, RunState

__all__ = ["DistributedRun", "dcp_access", "is_distributed", "refuse_in_one_process", "world_facts"]

T = TypeVar("T")

#: environment.json keys that describe the parallelism (spec/runstate.md RS-D5).
WORLD_SIZE = "world_size"
LAYOUT = "layout."
RESHARD_NOTE = "the run is no longer bit-comparable to its past"


def is_distributed(process_group: Any, run_dir: str) -> bool:
    """A run state is distributed when given a group, or built in an initialised job, or
    built in one process on a run directory a distributed run saved into (which it may
    only resume with a reshard, RS-D7)."""
    if process_group is not None or files.list_checkpoints(run_dir, files.DCP_SUFFIX):
        return True
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


# ---------------------------------------------------------------------------- state access


def dcp_access() -> Access:
    """Module and optimizer state through ``torch.distributed.checkpoint.state_dict``.

    ``get_optimizer_state_dict`` initialises an optimizer that has not stepped (a
    zero-gradient step at lr 0, which advances Adam's step counter): the state of a
    fresh optimizer is reported as having none, and restoring "none" empties it
    again, so taking or restoring a copy never changes the run.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    def optim_state(opt: Any, model: Any) -> Any:
        fresh = not opt.state
        sd = get_optimizer_state_dict(model, opt)
        if fresh:
            opt.state.clear()
            sd = {**sd, "state": {}}
        return sd

    def load_optim(opt: Any, model: Any, sd: Any) -> None:
        if sd["state"]:
            set_optimizer_state_dict(model, opt, sd)
            return
        opt.state.clear()
        for group, saved in zip(opt.param_groups, sd["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def load_model(model: Any, sd: Any) -> None:
        set_model_state_dict(model, sd)

    return Access(get_model_state_dict, load_model, optim_state, load_optim)


def layout_of(module: Any) -> str:
    """``ddp``, ``fsdp2 mesh 2`` (the mesh shape, ``2x4`` for two dimensions) or ``plain``."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return "ddp"
    if isinstance(module, FSDPModule):
        params = cast(torch.nn.Module, module).parameters()  # fully_shard mixes FSDPModule into the module's class
        mesh = next((p.device_mesh for p in params if isinstance(p, DTensor)), None)
        return "fsdp2" if mesh is None else "fsdp2 mesh " + "x".join(map(str, mesh.shape))
    return "plain"


def world_facts(world: int, modules: Mapping[str, Any]) -> dict[str, Any]:
    """The parallelism a run records in ``environment.json``: world size, each module's layout."""
    return {WORLD_SIZE: world, **{f"{LAYOUT}{name}": layout_of(m) for name, m in sorted(modules.items())}}


def _describe(facts: Mapping[str, Any]) -> str:
    if WORLD_SIZE not in facts:
        return "one process (no process group)"
    layouts = ", ".join(f"{k[len(LAYOUT) :]}: {v}" for k, v in sorted(facts.items()) if k.startswith(LAYOUT))
    return f"world size {facts[WORLD_SIZE]}" + (f" ({layouts})" if layouts else "")


def world_size_changed(run_dir: str, saved: Mapping[str, Any], now: Mapping[str, Any]) -> WorldSizeChanged:
    """The refusal of a resume at another world size or layout, saying both and what to do."""
    if WORLD_SIZE in saved:
        todo = (
            f"run it with torchrun --nproc_per_node {saved[WORLD_SIZE]} and the same parallelism, or resume with "
            f"reshard=True (--reshard, under torchrun): DCP reshards the model and optimizer, the data positions are "
            f"re-derived from their offset rule, and {RESHARD_NOTE}"
        )
    else:
        todo = "resume it in one process (python, not torchrun), the way it was saved"
    return WorldSizeChanged(
        f"{run_dir}: saved at {_describe(saved)}, resumed at {_describe(now)}; a checkpoint continues the same run "
        f"bit for bit only at the world size and layout it was saved at: {todo}",
        dict(saved),
        dict(now),
    )


def refuse_in_one_process(run_dir: str) -> None:
    """A one-process RunState refuses a run directory a distributed run saved into.

    Raises:
        WorldSizeChanged: the directory holds ``step-*.dcp`` checkpoints.
    """
    if files.list_checkpoints(run_dir, files.DCP_SUFFIX):
        try:
            saved = _world(files.read_environment(run_dir))
        except CheckpointError:
            saved = {WORLD_SIZE: "N (environment.json is unreadable)"}
        raise world_size_changed(run_dir, saved, {})


def _aside(path: str, what: str) -> str:
    """A hidden directory beside a checkpoint (never listed as one), for replacing it."""
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}.{what}")


def _sweep_aside(run_dir: str) -> list[str]:
    """Remove what an interrupted replacement left beside its checkpoint (``_aside``)."""
    gone = []
    for name in sorted(os.listdir(run_dir)):
        if name.startswith(".step-") and name.endswith((f"{files.DCP_SUFFIX}.old", f"{files.DCP_SUFFIX}.new")):
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
            gone.append(name)
    return gone


def _world(facts: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in facts.items() if k == WORLD_SIZE or k.startswith(LAYOUT)}


# ---------------------------------------------------------------------------- collectives


def _portable(e: BaseException, rank: int) -> CheckpointError:
    """``e`` as it can travel to the other ranks (pickled in memory): itself when it survives."""
    if isinstance(e, CheckpointError):
        with contextlib.suppress(Exception):
            back = pickle.loads(pickle.dumps(e))
            if type(back) is type(e) and str(back) == str(e):
                return e
    line = f"{type(e).__name__}: {e}"
    return DistributedFailure(f"rank {rank}: {line}", {rank: line})


class Group:
    """A process group's collectives, each bounded by the group's timeout; a peer that
    died makes them fail with :class:`DistributedFailure` instead of hanging. Without an
    initialised ``torch.distributed`` it is one process alone (world size 1), whose
    collectives are the identity: a distributed run resumed in one process (RS-D7)."""

    def __init__(self, process_group: Any) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.group = process_group
        self.alone = process_group is None and not (dist.is_available() and dist.is_initialized())
        self.rank = 0 if self.alone else dist.get_rank(process_group)
        self.world = 1 if self.alone else dist.get_world_size(process_group)

    def _collective(self, what: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except RuntimeError as e:
            line = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            raise DistributedFailure(
                f"rank {self.rank}: {what} failed ({line}); another rank probably failed or was killed",
                {self.rank: line},
            ) from e

    def gather(self, value: Any, what: str) -> list[Any]:
        if self.alone:
            return [value]
        out: list[Any] = [None] * self.world
        self._collective(what, lambda: self.dist.all_gather_object(out, value, group=self.group))
        return out

    def agree(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` on every rank; if it raised on any, raise on all (this rank's own
        error, else the lowest failing rank's)."""
        try:
            value, err = fn(), None
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others hang
            value, err = None, e
        errors = self.gather(None if err is None else _portable(err, self.rank), what)
        if err is not None:
            raise err
        for other in errors:
            if other is not None:
                raise other
        return value  # type: ignore[return-value]

    def from_rank0(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` on rank 0, its result (or its error) on every rank."""
        err: BaseException | None = None
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", fn())
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                err = e
                box[0] = ("err", _portable(e, 0))
        if not self.alone:
            self._collective(what, lambda: self.dist.broadcast_object_list(box, group=self.group, group_src=0))
        if err is not None:
            raise err
        status, value = box[0]
        if status == "err":
            raise value
        return value  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------- the run


class DistributedRun:
    """The collective half of a distributed :class:`~ckptkit.runstate.RunState`."""

    def __init__(self, rs: RunState, process_group: Any, async_save: bool) -> None:
        self.rs = rs
        self.g = Group(process_group)
        rs._reg.access = dcp_access()
        self._saver: Any = None
        self._pending: tuple[str, str] | None = None  # (checkpoint, where DCP writes it) until committed
        if async_save and not self.g.alone:  # one process alone saves synchronously (no group to save on)
            import ckptkit.distributed as ckd

            self._saver = ckd.AsyncSaver(process_group)

    @property
    def rank(self) -> int:
        return self.g.rank

    @property
    def world(self) -> int:
        return self.g.world

    def path(self, step: int) -> str:
        return os.path.join(self.rs.run_dir, files.checkpoint_name(step, files.DCP_SUFFIX))

    def facts(self) -> dict[str, Any]:
        reg = self.rs._reg
        modules = dict(reg.models)
        if reg.teacher is not None:
            modules["teacher"] = reg.teacher
        return world_facts(self.world, modules)

    # ------------------------------------------------------------------ save

    def save(self, step: int) -> str:
        """Collective save of ``step`` (RS-D3): the replicas checked, rank 0's companions,
        then every rank's share through DCP, ``metadata.ckdcp`` last."""
        import ckptkit.distributed as ckd

        self.wait()
        rs, path = self.rs, self.path(step)
        ckpt = rs.checkpoint(step)
        config = encode_snapshot(rs.config)
        sidecars = rs.sidecar_contents()
        self._check_replicas(step, ckpt, config, sidecars)
        record, into = self.g.from_rank0(
            lambda: self._companions(path, step, config, sidecars), "writing the companions"
        )
        state = self._state(ckpt, record)
        self._pending = (path, into)
        if self._saver is not None:
            self._saver.save(state, into)
            return path
        ckd.save(state, into, process_group=self.g.group)
        self._commit()
        return path

    def _companions(
        self, path: str, step: int, config: bytes, sidecars: Mapping[str, Any]
    ) -> tuple[dict[str, Any], str]:
        """Rank 0: the companions written; where DCP writes (beside ``path`` when a committed
        checkpoint is there: a rollback saves its step again, replacing it only once committed)."""
        from .distributed.format import METADATA_NAME

        os.makedirs(self.rs.run_dir, exist_ok=True)
        into = path
        if os.path.exists(os.path.join(path, METADATA_NAME)):
            into = _aside(path, "new")
        # What an earlier save of this step left uncommitted (a dead rank's temp file included) goes first.
        shutil.rmtree(into, ignore_errors=True)
        return files.write_companions(path, step, config, sidecars), into

    def _commit(self) -> None:
        """After DCP committed: a replacement takes the old directory's place, then retention."""
        path, into = self._pending or ("", "")
        self._pending = None
        if into != path:

            def swap() -> None:
                if self.rank == 0:
                    old = _aside(path, "old")
                    shutil.rmtree(old, ignore_errors=True)
                    os.rename(path, old)
                    os.rename(into, path)
                    fsync_dir(self.rs.run_dir)
                    shutil.rmtree(old)

            self.g.agree(swap, "replacing the checkpoint")
        self._retain()

    def _check_replicas(self, step: int, ckpt: Checkpoint, config: bytes, sidecars: Mapping[str, Any]) -> None:
        """Refuse, on every rank, replicated state whose copies differ (RS-D4)."""
        reg, mon, optim = self.rs._reg, ckpt.monitor or {}, ckpt.optim or {}
        parts: dict[str, Any] = {"config": config, "flags": ckpt.flags}
        for group in ("schedulers", "scalers"):
            parts.update({f"{group}.{n}": sd for n, sd in (optim.get(group) or {}).items()})
        parts.update({f"monitors.{n}": st for n, st in (mon.get("monitors") or {}).items()})
        parts.update({f"values.{n}": v for n, v in (mon.get("values") or {}).items() if not reg.values[n].per_rank})
        parts.update({f"sidecars.{kind}": list(c) for kind, c in sidecars.items()})
        everyone = self.g.gather({k: tree_digest(v, k) for k, v in parts.items()}, "comparing replicated state")
        differ: dict[str, list[list[int]]] = {}
        for piece in parts:
            copies: dict[int, list[int]] = {}
            for rank, digests in enumerate(everyone):
                copies.setdefault(digests.get(piece, -1), []).append(rank)
            if len(copies) > 1:
                differ[piece] = sorted(copies.values())
        if differ:
            said = "; ".join(
                f"{piece} ({' | '.join('ranks ' + ', '.join(map(str, r)) for r in groups)})"
                for piece, groups in differ.items()
            )
            raise ReplicaDivergence(
                f"{self.path(step)}: not saved: replicated state differs between ranks: {said}; every rank must "
                "hold the same copy of replicated state (rank 0's is saved); state that is per-rank by nature must "
                "be registered per rank (add_value(..., per_rank=True); data positions always are)",
                differ,
            )

    def _state(self, ckpt: Checkpoint, record: dict[str, Any]) -> dict[str, Any]:
        """The DCP state dict of ``ckpt`` (the module docstring's layout)."""
        reg, mon, optim = self.rs._reg, ckpt.monitor or {}, ckpt.optim or {}
        values = mon.get("values") or {}
        mine = {
            "data": mon.get("data") or {},
            "values": {n: v for n, v in values.items() if reg.values[n].per_rank},
        }
        state: dict[str, Any] = {
            "model": ckpt.model or {},
            "optim": optim.get("optimizers") or {},
            "ranks": {str(self.rank): (mine,)},
        }
        if ckpt.teacher is not None:
            state["teacher"] = ckpt.teacher
        if self.rank == 0:
            run = {
                "step": ckpt.step,
                "flags": ckpt.flags,
                "optim": {k: v for k, v in optim.items() if k != "optimizers"},
                "monitors": mon.get("monitors") or {},
                "values": {n: v for n, v in values.items() if not reg.values[n].per_rank},
                "world": self.facts(),
                "registered": {
                    "models": sorted(reg.models),
                    "optimizers": sorted(reg.optimizers),
                    "teacher": reg.teacher is not None,
                },
                "companions": record,
            }
            state["run"] = (run,)  # DCP flattens dicts and lists, never a tuple: one plain value
        return state

    def wait(self) -> None:
        """Block until a background save committed, then apply retention.

        Raises:
            CheckpointError: the background save failed (on every rank).
        """
        if self._pending is not None and self._saver is not None:
            self._saver.wait()
            self._commit()

    def close(self) -> None:
        if self._saver is not None:
            try:
                self.wait()
            finally:
                self._saver.close()
                self._saver = None

    # ------------------------------------------------------------------ the run directory

    def _retain(self) -> None:
        rs = self.rs

        def rank0() -> None:
            if self.rank == 0:
                files.retain(rs.run_dir, rs.keep, self._delete, rs._log, files.DCP_SUFFIX)

        self.g.agree(rank0, "retention")  # the agreement is the barrier: no rank lists a step being deleted

    def _delete(self, path: str) -> None:
        """Uncommit first (the metadata), then the rank files, then the companions."""
        from .distributed.format import METADATA_NAME

        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, METADATA_NAME))
        if os.path.isdir(path):
            shutil.rmtree(path)
        for p in [snapshot_path(path)] + [sidecar_path(path, k) for k in self.rs._reg.sidecars]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    def checkpoints(self) -> list[tuple[int, str]]:
        """The committed steps (``metadata.ckdcp`` present), as a one-process run lists its files."""
        from .distributed.format import METADATA_NAME

        self.wait()
        steps = files.list_checkpoints(self.rs.run_dir, files.DCP_SUFFIX)
        return [(s, p) for s, p in steps if os.path.exists(os.path.join(p, METADATA_NAME))]

    def discard_after(self, step: int) -> list[str]:
        """Every step directory after ``step``, committed or not (an abandoned timeline's)."""
        self.wait()
        gone = [p for s, p in files.list_checkpoints(self.rs.run_dir, files.DCP_SUFFIX) if s > step]

        def rank0() -> None:
            if self.rank == 0:
                for p in gone:
                    self._delete(p)

        self.g.agree(rank0, "discarding checkpoints")
        return gone

    def start(self) -> int:
        """Rank 0 refuses a used directory or records the environment with the world facts."""
        run_dir = self.rs.run_dir
        facts = self.facts()

        def rank0() -> None:
            if files.list_checkpoints(run_dir):
                raise world_size_changed(run_dir, {}, facts)
            files.refuse_existing(run_dir, files.list_checkpoints(run_dir, files.DCP_SUFFIX))
            os.makedirs(run_dir, exist_ok=True)
            clean_stale_temps(run_dir)
            record = {**capture(), **facts}
            write_bytes_atomic(
                os.path.join(run_dir, ENVIRONMENT_FILE), (json.dumps(record, sort_keys=True, indent=2) + "\n").encode()
            )

        self.g.from_rank0(rank0, "starting the run")
        return 0

    def has_checkpoints(self) -> bool:
        run_dir = self.rs.run_dir

        def rank0() -> bool:
            return bool(files.list_checkpoints(run_dir, files.DCP_SUFFIX) or files.list_checkpoints(run_dir))

        return self.g.from_rank0(rank0, "listing checkpoints")

    # ------------------------------------------------------------------ resume

    def resume(self, *, reshard: bool, allow_env_change: bool) -> ResumeInfo:
        """Collective resume (RS-D6): rank 0 chooses, every rank checks, then DCP loads."""
        from .runstate import ResumeInfo

        self.wait()
        path, notes, skipped = self.g.from_rank0(self._choose, "choosing the checkpoint")
        c = self.g.agree(lambda: self._check(path, reshard, allow_env_change), "checking the checkpoint")
        self.rs.restore(self._load(path, c.ckpt), sidecars=c.sidecars)
        notes = [*notes, *c.notes]
        for n in notes:
            self.rs._log(n)
        return ResumeInfo(
            c.ckpt.step, path, tuple(notes), tuple(skipped), tuple(c.exempt), tuple(c.env), resharded=c.resharded
        )

    def _choose(self) -> tuple[str, list[str], list[tuple[str, str]]]:
        """Rank 0: the newest checkpoint that verifies with its companions; every fallback said."""
        run_dir = self.rs.run_dir
        if files.list_checkpoints(run_dir):
            raise world_size_changed(run_dir, {}, self.facts())
        removed = clean_stale_temps(run_dir) + _sweep_aside(run_dir)
        notes = [f"removed {len(removed)} temporary file(s) left by an interrupted save"] if removed else []
        candidates = files.list_checkpoints(run_dir, files.DCP_SUFFIX)
        run, path, skipped = files.newest_consistent(run_dir, candidates, self._consistent)
        notes += files.fallback_notes(skipped, path, run["step"])
        if record_of(run) is None:
            notes.append(f"{os.path.basename(path)} {UNBOUND_NOTE}")
        return path, notes, skipped

    def _consistent(self, named_step: int, path: str) -> dict[str, Any]:
        from .distributed.format import read_metadata, verify_directory

        report = verify_directory(path)
        if report.error is not None:
            raise report.error
        run = run_tree(read_metadata(path), path)
        if run["step"] != named_step:
            raise FormatError(
                "the stored step does not match the directory name",
                path=path,
                field="run.step",
                expected=named_step,
                actual=run["step"],
                hint="a checkpoint renamed or copied over another; resume from another",
            )
        if not os.path.exists(snapshot_path(path)):
            raise CheckpointNotFound(f"{snapshot_path(path)}: config snapshot is missing")
        sidecars = {
            kind: read_sidecar(sidecar_path(path, kind), expect_step=named_step) for kind in self.rs._reg.sidecars
        }
        check_companions(path, record_of(run, path), sidecars=sidecars)
        read_snapshot(snapshot_path(path))
        return run

    def _check(self, path: str, reshard: bool, allow_env_change: bool) -> _Checked:
        """Every rank: world, config, environment and registrations, before anything is loaded."""
        from .distributed.format import read_metadata

        rs = self.rs
        md = read_metadata(path)
        run = run_tree(md, path)
        saved, now = run["world"], self.facts()
        resharded = saved != now
        if resharded and not reshard:
            raise world_size_changed(rs.run_dir, saved, now)
        exempt = check_resume(read_snapshot(snapshot_path(path)), rs.config, exempt=rs.exempt)
        recorded = files.read_environment(rs.run_dir)
        env = check_environment(
            {k: v for k, v in recorded.items() if k not in _world(recorded)}, capture(), allow=allow_env_change
        )
        sidecars = {kind: read_sidecar(sidecar_path(path, kind), expect_step=run["step"]) for kind in rs._reg.sidecars}
        ckpt, notes = self._plain_state(path, md, run, resharded)
        rs._reg.check_contents(ckpt, path)
        notes = [d.describe() for d in exempt] + [f"environment override: {d}" for d in env] + notes
        if resharded:
            notes.append(
                f"resharded at step {run['step']} from {_describe(saved)} to {_describe(now)}: {RESHARD_NOTE} "
                "(the steps before it ran at another world size or layout)"
            )
        sc = {k: (v.table_step, v.tree) for k, v in sidecars.items()}
        return _Checked(ckpt, sc, exempt, env, notes, resharded)

    def load_checkpoint(self, step: int) -> tuple[Checkpoint, dict[str, tuple[int, Any]]]:
        """This rank's contents of the committed step ``step``, loaded into copies, and its sidecars."""
        from .distributed.format import read_metadata

        path = self.path(step)
        md = read_metadata(path)
        run = run_tree(md, path)
        ckpt, _notes = self._plain_state(path, md, run, resharded=False)
        sidecars = {k: read_sidecar(sidecar_path(path, k), expect_step=step) for k in self.rs._reg.sidecars}
        return self._load(path, ckpt, copy=True), {k: (sc.table_step, sc.tree) for k, sc in sidecars.items()}

    def _plain_state(self, path: str, md: Any, run: dict[str, Any], resharded: bool) -> tuple[Checkpoint, list[str]]:
        """The checkpoint as far as it is plain values, for the registration checks: the
        stored modules stand in as their live selves (DCP checks keys, shapes and dtypes
        when it loads). With a reshard, the data positions come from their offset rules,
        and a rank the saved world lacked takes saved rank 0's per-rank values:
        ``(checkpoint, notes)``."""
        reg, step = self.rs._reg, run["step"]
        saved_world = run["world"].get(WORLD_SIZE, 1)
        source = self.rank if not resharded or self.rank < saved_world else 0
        mine = rank_tree(md, path, source)
        values = {**run["values"], **mine["values"]}
        data, notes = mine["data"], []
        if resharded:
            per = sorted(n for n, e in reg.values.items() if e.per_rank)
            if per and source != self.rank:
                notes.append(f"rank {self.rank} takes its per-rank value(s) {', '.join(per)} from saved rank 0")
            data = {name: self._rederived(path, name, entry, step, values) for name, entry in reg.data.items()}
        registered = run["registered"]
        optim = {"optimizers": dict.fromkeys(registered["optimizers"]), **run["optim"]}
        monitor = {"data": data, "monitors": run["monitors"], "values": values}
        teacher = None
        if registered["teacher"]:
            teacher = {} if reg.teacher is None else reg.access.model_state(reg.teacher)
        ckpt = Checkpoint(
            step=step,
            model={n: reg.access.model_state(reg.models[n]) if n in reg.models else {} for n in registered["models"]}
            or None,
            optim={k: v for k, v in optim.items() if v} or None,
            teacher=teacher,
            monitor={k: v for k, v in monitor.items() if v} or None,
            flags=run["flags"],
        )
        return ckpt, notes

    def _rederived(self, path: str, name: str, entry: Any, step: int, values: Mapping[str, Any]) -> int:
        want = entry.expected_at(step, values)
        if want is None:
            raise ResumeRefused(
                f"{path}: data position {name!r} has no offset rule, so a reshard cannot re-derive it for rank "
                f"{self.rank} of {self.world}; register it with add_data_position(..., expected=...)"
            )
        return int(want)

    def _load(self, path: str, ckpt: Checkpoint, *, copy: bool = False) -> Checkpoint:
        """Every rank: DCP loads the modules and optimizers (resharding as needed) into
        destinations shaped like the live ones (``copy``: into copies of them, the live
        objects untouched); ``ckpt`` with them."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        import ckptkit.distributed as ckd

        from .distributed.format import read_metadata

        reg = self.rs._reg
        stored = set(read_metadata(path).tensors)
        optim = {}
        for n, o in reg.optimizers.items():
            model = reg.optimizer_models[n]
            if any(k.startswith(f"optim.{n}.state.") for k in stored):
                # an optimizer that had stepped: a destination for its state (DCP fills only what it is given)
                fresh = not o.state
                optim[n] = get_optimizer_state_dict(model, o)
                if fresh and copy:
                    o.state.clear()  # the zero-gradient initialisation, undone (see dcp_access)
            else:
                optim[n] = reg.access.optim_state(o, model)
        dest: dict[str, Any] = {"model": {n: reg.access.model_state(m) for n, m in reg.models.items()}, "optim": optim}
        if reg.teacher is not None:
            dest["teacher"] = reg.access.model_state(reg.teacher)
        if copy:
            dest = clone(dest)
            optim = dest["optim"]
        ckd.load(dest, path, process_group=self.g.group)
        return dataclasses.replace(
            ckpt,
            model=dest["model"] or None,
            optim={**(ckpt.optim or {}), "optimizers": optim} if optim else ckpt.optim,
            teacher=dest.get("teacher"),
        )


@dataclass
class _Checked:
    """What every rank's checks of a resume found: the checkpoint's plain state (its
    tensors not loaded yet), the sidecars, and what the resume reports."""

    ckpt: Checkpoint
    sidecars: dict[str, tuple[int, Any]]
    exempt: list[Any]
    env: list[Any]
    notes: list[str]
    resharded: bool


def run_tree(md: Any, path: str) -> dict[str, Any]:
    """The ``run`` value of a distributed RunState checkpoint's metadata.

    Raises:
        MalformedIndex: it is missing or not shaped as RunState writes it.
    """
    keys = {"step", "flags", "optim", "monitors", "values", "world", "registered", "companions"}
    hint = "not a RunState checkpoint (a plain ckptkit.distributed.save?), or one written by a newer ckptkit"
    return _plain_value(md, "run", keys, path, "the run state", hint)


def rank_tree(md: Any, path: str, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s own state (``ranks.<rank>``) in a checkpoint's metadata.

    Raises:
        MalformedIndex: it is missing or malformed.
    """
    hint = "a damaged checkpoint, or one saved at another world size (resume it with reshard=True)"
    return _plain_value(md, f"ranks.{rank}", {"data", "values"}, path, f"rank {rank}'s own state", hint)


def _plain_value(md: Any, key: str, keys: set[str], path: str, what: str, hint: str) -> dict[str, Any]:
    value = md.values.get(key)
    if isinstance(value, tuple) and len(value) == 1 and isinstance(value[0], dict) and set(value[0]) == keys:
        return value[0]
    raise MalformedIndex(f"{what} is missing or malformed", path=path, field=key, hint=hint)
