"""The DCP store: one ``ckptkit.distributed`` directory per step, written by every rank.

A :class:`~ckptkit.RunState` given ``process_group=``, or built inside an initialised
``torch.distributed`` job, or on a run directory a distributed run saved into,
keeps its checkpoints here (spec/runstate.md "Distributed run state", RS-D1..RS-D9).
Every method is collective: each rank calls it, in the same order; rank 0 writes the
companions and deletes, through the run's group, and every rank loads its share.

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

import dataclasses
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import (
    DistributedFailure,
    MalformedIndex,
    ReplicaDivergence,
    ResumeRefused,
    UnsupportedValue,
)
from ..format._checkpoint import Checkpoint
from ..format._companions import record_of
from ..format._place import Place, list_run_dir
from ..format._section import check_plain
from ..format._tree import clone, tree_digest
from . import _files as files
from ._group import RESHARD_NOTE, WORLD_SIZE, Alone, Group, describe_world, world_facts, world_size_changed
from ._registry import Access, Registry
from ._store import Opened

__all__ = ["DcpStore", "dcp_access", "rank_tree", "run_tree"]


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


def _sweep_aside(run_dir: str) -> list[str]:
    """Remove what an interrupted replacement left beside its checkpoint: the Writer's
    staging directory ``.step-N.dcp.new`` (``storage.staging_path``), and ``.old`` ones
    that ckptkit versions before the atomic swap left."""
    gone = []
    for name in sorted(list_run_dir(run_dir)):
        if name.startswith(".step-") and name.endswith((f"{files.DCP_SUFFIX}.old", f"{files.DCP_SUFFIX}.new")):
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
            gone.append(name)
    return gone


class DcpStore(files.RunRecords):
    """``step-N.dcp`` checkpoints at the run's place, saved and loaded by every rank of ``group``.

    In a local run directory a step is a ``step-N.dcp/`` directory with rank 0's companions
    beside it. Under an ``s3://`` prefix it is the objects of a :mod:`ckptkit.distributed`
    checkpoint at ``run_dir/step-N.dcp`` (its metadata, every rank's data file) and rank 0's
    companions, all listed by its one commit record (spec/objectstore.md R-O35..R-O37). No rank
    shares a stage with another (a node may be another machine): a step is checked and opened
    from the rank's stage, where an object prefix fetches its metadata and companions first, each
    checked against the record, by the same checks; its rank files are never copied: the load
    reads the byte ranges of the chunks this rank's plan needs, each checked against its digest,
    so each rank fetches about its share (R-O36).
    """

    suffix = files.DCP_SUFFIX
    names_optimizer_models = True  # DCP saves an optimizer's state by its model's parameter names

    def __init__(
        self,
        place: Place,
        reg: Registry,
        group: Group,
        *,
        keep: int,
        compression: str,
        async_save: bool,
        log: Callable[[str], None],
    ) -> None:
        if compression != "raw":
            raise ValueError(f"compression must be 'raw' in a distributed run (got {compression!r})")
        self.place, self.run_dir = place, place.where
        self.reg, self.g, self.keep, self.log = reg, group, keep, log
        reg.access = dcp_access()
        self._saver: Any = None
        self._pending: str | None = None  # the checkpoint being saved, until committed
        self._staged: dict[str, bytes] | None = None  # rank 0's companions, for a writer that commits them
        if async_save and not isinstance(group, Alone):  # one process alone saves synchronously (no group to save on)
            import ckptkit.distributed as ckd

            self._saver = ckd.AsyncSaver(group.group)

    @property
    def rank(self) -> int:
        return self.g.rank

    @staticmethod
    def saved_into(place: Place) -> bool:
        """A distributed run saved a step at ``place`` (so a resume in one process takes this store,
        with a reshard: RS-D7)."""
        return bool(place.names(files.DCP_SUFFIX))

    def path(self, step: int) -> str:
        return self.place.child(files.checkpoint_name(step, files.DCP_SUFFIX))

    def committed(self) -> list[tuple[int, str]]:
        """The committed steps (``metadata.ckdcp`` present, or committed by its record)."""
        self.wait()
        return self.steps(files.DCP_SUFFIX, committed=True)

    def facts(self) -> dict[str, Any]:
        modules = dict(self.reg.models)
        if self.reg.teacher is not None:
            modules["teacher"] = self.reg.teacher
        return world_facts(self.g.world, modules)

    def refuse_foreign(self) -> None:
        """A distributed run refuses a run directory a one-process run saved into.

        Raises:
            WorldSizeChanged: the directory holds ``step-*.ckpt`` checkpoints (R-O35).
        """
        if self.steps(files.CKPT_SUFFIX):
            raise world_size_changed(self.run_dir, {}, self.facts())

    def refuse_unstorable(self, kind: str, name: str, obj: Any) -> None:
        """Schedulers, scalers and statefuls are replicated plain state; modules and optimizers go through DCP."""
        if kind in ("scheduler", "scaler", "stateful"):
            try:
                check_plain(obj.state_dict(), f"{kind} {name!r}")
            except UnsupportedValue as e:
                raise UnsupportedValue(
                    f"{e}; a distributed run saves schedulers, scalers and statefuls as plain values"
                ) from None

    # ------------------------------------------------------------------ save

    def save(self, step: int, ckpt: Checkpoint, config: bytes, sidecars: Mapping[str, tuple[int, Any]]) -> str:
        """Collective save of ``step`` (RS-D3): the replicas checked, rank 0's companions,
        then every rank's share through DCP, ``metadata.ckdcp`` last."""
        import ckptkit.distributed as ckd

        self.wait()
        path = self.path(step)
        self._check_replicas(step, ckpt, config, sidecars)
        record = self.g.from_rank0(lambda: self._companions(path, step, config, sidecars), "writing the companions")
        state = self._state(ckpt, record)
        self._pending = path
        companions, self._staged = self._staged, None
        # overwrite: a rollback saves its step again; the Writer commits the new directory
        # beside the old one and swaps the two atomically (spec/distributed.md §1)
        if self._saver is not None:
            self._saver.save(state, path, overwrite=True, companions=companions)
            return path
        ckd.save(state, path, process_group=self.g.group, overwrite=True, companions=companions)
        self._commit()
        return path

    def _companions(self, path: str, step: int, config: bytes, sidecars: Mapping[str, Any]) -> dict[str, Any]:
        """Rank 0: the companions written in the stage, after removing what an earlier save of this
        step left uncommitted (a dead rank's temp file included); a committed one stays until replaced
        where the place replaces atomically, else goes now (R-O38: every rank waits for rank 0 here,
        before it writes). A writer that commits them with the checkpoint takes them (R-O36); the
        history goes before the commit (a commit never outruns its rows, R-O37)."""
        from ..distributed._format import METADATA_NAME

        name, here = path.rpartition("/")[2], self._here(path)
        self.place.make_room(name)
        os.makedirs(self.place.stage, exist_ok=True)
        if not os.path.exists(os.path.join(here, METADATA_NAME)):
            shutil.rmtree(here, ignore_errors=True)
        if not os.path.exists(os.path.join(self.place.stage, files.ENVIRONMENT_FILE)):
            self.place.bring(files.ENVIRONMENT_FILE)  # the companion record carries its digest
        parts = files.step_paths(here, sorted(sidecars))[1:]
        files.set_aside(parts, step, self.log)  # a damaged step's companions
        record = files.write_companions(here, step, config, sidecars)
        self._staged = self.place.hand_over(name, [os.path.basename(p) for p in parts])
        self.send_records()
        return record

    def _commit(self) -> None:
        """After DCP committed (the replacement, if any, swapped in): retention."""
        self._pending = None
        self.g.on_rank0(self._retain, "retention")  # the agreement is the barrier: no rank lists a step being deleted

    def _check_replicas(self, step: int, ckpt: Checkpoint, config: bytes, sidecars: Mapping[str, Any]) -> None:
        """Refuse, on every rank, replicated state whose copies differ (RS-D4)."""
        reg, mon, optim = self.reg, ckpt.monitor or {}, ckpt.optim or {}
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
        reg, mon, optim = self.reg, ckpt.monitor or {}, ckpt.optim or {}
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
        try:
            if self._saver is not None:
                try:
                    self.wait()
                finally:
                    self._saver.close()
                    self._saver = None
            if self.rank == 0:
                self.send_records()
        finally:
            self.place.close()

    def _retain(self) -> None:
        files.retain(self.place.stage, self.listing(), self.keep, self.delete, self.log, files.DCP_SUFFIX)

    def delete(self, path: str) -> None:
        """Uncommit first (the metadata, or the record), then the rank files, then the companions."""
        from ..distributed._format import METADATA_NAME

        here = self._here(path)
        companions = files.step_paths(here, self.reg.sidecars)[1:]
        self.place.remove(
            path.rpartition("/")[2], [os.path.join(here, METADATA_NAME), os.path.join(here, ""), *companions]
        )

    # ------------------------------------------------------------------ resume

    def sweep(self) -> list[str]:
        """Rank 0: what interrupted saves left, a step's rank objects included (R-O16)."""
        stage = self.place.stage
        left = self.place.sweep(files.DCP_SUFFIX, lambda name: files.step_of(name, files.DCP_SUFFIX) is not None)
        return left + _sweep_aside(stage) + files.remove_debris(stage)

    def _copy(self, path: str) -> str:
        """The stage's copy of the step at ``path`` (an object prefix fetches the metadata and the
        companions, each checked, R-O14, not the rank files: R-O36), with the run's environment
        record (the companion record checks its digest)."""
        from ..distributed._objects import is_rank_key, local_name

        name = path.rpartition("/")[2]
        here = self.place.fetch(name, local_name, only=lambda key: not is_rank_key(name, key))
        self.place.bring(files.ENVIRONMENT_FILE)
        return here

    def check(self, step: int, path: str) -> dict[str, Any] | None:
        """A local step: every byte. On an object prefix the rank files are not read here: each
        rank's load checks the chunks it reads, and a damaged one is passed over then (R-O36)."""
        from ..distributed._format import read_metadata, verify_directory

        here = self._copy(path)
        if not self.place.fetches:
            report = verify_directory(path)
            if report.error is not None:
                raise report.error
        run = run_tree(read_metadata(here, check_files=False), here)  # the files: verified above, or by the load
        files.check_step(here, step, run["step"], field="run.step", what="the stored step")
        files.read_companions(here, step, self.reg.sidecars, run)
        return record_of(run)

    def open(self, path: str, *, reshard: bool) -> Opened:
        """This rank's view of the checkpoint: the world checked, its plain state (the stored
        modules stand in as their live selves: DCP checks keys, shapes and dtypes when it
        loads), and its sidecars."""
        from ..distributed._format import read_metadata

        here = self._copy(path)
        md = read_metadata(here, check_files=False)  # the load below checks the rank files (R-DC06)
        run = run_tree(md, here)
        saved, now = run["world"], self.facts()
        resharded = saved != now
        if resharded and not reshard:
            raise world_size_changed(self.run_dir, saved, now)
        sidecars = files.restorable(files.read_sidecars(here, run["step"], self.reg.sidecars))
        ckpt, notes = self._plain_state(here, md, run, resharded)
        if resharded:
            notes.append(
                f"resharded at step {run['step']} from {describe_world(saved)} to {describe_world(now)}: "
                f"{RESHARD_NOTE} (the steps before it ran at another world size or layout)"
            )
        return Opened(ckpt, sidecars, resharded, notes, checked_whole=not self.place.fetches)

    def load(self, path: str, opened: Opened, *, copy: bool = False) -> Checkpoint:
        try:
            here = self._copy(path)
            if not self.place.fetches:
                return self._load(here, path, opened.ckpt, copy=copy)
            return self._load_ranged(here, path, opened.ckpt)
        finally:
            self.place.release(path.rpartition("/")[2])

    def _load_ranged(self, here: str, path: str, ckpt: Checkpoint) -> Checkpoint:
        """The load of a step on an object prefix, whose rank files :meth:`check` did not read: into
        copies, so that a damaged chunk changes nothing registered. Damage found on any rank is
        raised on every rank (its own, else the lowest damaged rank's), which the resume passes
        over (R-O36); where a rank failed otherwise, no rank raises it as damage.

        Raises:
            FormatError, CheckpointNotFound, UnreadableFile: a chunk or rank file is damaged.
            DistributedFailure: a rank failed otherwise (its error, on the other ranks).
        """
        err: Exception | None = None
        try:
            loaded = self.g.agree(lambda: self._load(here, path, ckpt, copy=True), "loading the checkpoint")
        except Exception as e:  # noqa: BLE001 - the ranks must agree on what it was
            err = e
        damaged = err is not None and files.is_damage(err)
        if not all(self.g.gather(damaged, "agreeing on the damage found")) and err is not None:
            if damaged:
                line = f"{type(err).__name__}: {err}"
                raise DistributedFailure(f"rank {self.rank}: {line}", {self.rank: line}) from err
            raise err
        if err is not None:
            raise err
        return loaded

    def _plain_state(self, path: str, md: Any, run: dict[str, Any], resharded: bool) -> tuple[Checkpoint, list[str]]:
        """The checkpoint as far as it is plain values, for the registration checks: the
        stored modules stand in as their live selves (DCP checks keys, shapes and dtypes
        when it loads). With a reshard, the data positions come from their offset rules,
        and a rank the saved world lacked takes saved rank 0's per-rank values:
        ``(checkpoint, notes)``."""
        reg, step = self.reg, run["step"]
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
                f"{self.rank} of {self.g.world}; register it with add_data_position(..., expected=...)"
            )
        return int(want)

    def _load(self, here: str, path: str, ckpt: Checkpoint, *, copy: bool = False) -> Checkpoint:
        """Every rank: DCP loads the modules and optimizers of ``path`` (resharding as needed), its
        metadata read at ``here``, into destinations shaped like the live ones (``copy``: into
        copies of them, the live objects untouched); ``ckpt`` with them."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        import ckptkit.distributed as ckd

        from ..distributed._format import read_metadata

        reg = self.reg
        stored = set(read_metadata(here, check_files=False).tensors)  # keys only; the load checks the files
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
