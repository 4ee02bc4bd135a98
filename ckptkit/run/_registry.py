"""What a run registered, and how it is checked against a checkpoint and restored.

Private: the parts behind :class:`ckptkit.run.RunState`. A :class:`Registry`
holds every registered object and accessor; it builds a checkpoint's contents,
refuses a checkpoint that does not match them (:class:`~ckptkit.errors.StateMismatch`,
:class:`~ckptkit.errors.StreamOffsetMismatch`), and restores one into them
(spec/runstate.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import StateMismatch, StreamOffsetMismatch
from ..format._checkpoint import Checkpoint
from ..format._container import FLAG_NAMES

__all__ = ["LOCAL", "Access", "Entry", "Registry", "has_state_dict"]


@dataclass(frozen=True)
class Access:
    """How a registered module's or optimizer's state is read and put back.

    One process uses the objects' own ``state_dict``/``load_state_dict``
    (:data:`LOCAL`); a process group uses ``torch.distributed.checkpoint.state_dict``'s
    functions (names without DDP's ``module.``, FSDP2 shards as DTensors), which need
    an optimizer's module too.
    """

    model_state: Callable[[Any], Any]
    load_model: Callable[[Any, Any], None]
    optim_state: Callable[[Any, Any], Any]  # (optimizer, its module or None)
    load_optim: Callable[[Any, Any, Any], None]  # (optimizer, its module or None, state)


LOCAL = Access(
    model_state=lambda m: m.state_dict(),
    load_model=lambda m, sd: m.load_state_dict(sd),
    optim_state=lambda o, _m: o.state_dict(),
    load_optim=lambda o, _m, sd: o.load_state_dict(sd),
)


@dataclass
class Entry:
    get: Callable[[], Any]
    set: Callable[[Any], None]
    # add_data_position's rule: (step, the checkpoint's stored values by name) -> position.
    expected: Callable[[int, Mapping[str, Any]], Any] | None = None
    # add_value(per_rank=True): each rank's own value (a distributed run keys it by rank).
    per_rank: bool = False

    def expected_at(self, step: int, values: Mapping[str, Any]) -> Any:
        """The position the rule wants at ``step`` (None when there is no rule)."""
        return None if self.expected is None else self.expected(step, values)


@dataclass
class Registry:
    models: dict[str, Any] = field(default_factory=dict)
    optimizers: dict[str, Any] = field(default_factory=dict)
    schedulers: dict[str, Any] = field(default_factory=dict)
    scalers: dict[str, Any] = field(default_factory=dict)
    teacher: Any = None
    monitors: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Entry] = field(default_factory=dict)
    values: dict[str, Entry] = field(default_factory=dict)
    flags: dict[str, Entry] = field(default_factory=dict)
    sidecars: dict[str, Entry] = field(default_factory=dict)
    optimizer_models: dict[str, Any] = field(default_factory=dict)  # optimizer name -> its module
    access: Access = LOCAL

    def check_name(self, kind: str, name: str, taken: Mapping[str, Any]) -> None:
        """Refuse a registration name that is empty or taken (``ValueError``)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{kind} name must be a non-empty string (got {name!r})")
        if name in taken:
            raise ValueError(f"{kind} {name!r} is already registered")

    def lr(self) -> float:
        """The LR of the first registered optimizer's first param group (NaN: none)."""
        for opt in self.optimizers.values():
            return float(opt.param_groups[0]["lr"])
        return math.nan

    def scale_lr(self, factor: float) -> None:
        """Multiply the LR of every param group (and its ``initial_lr``) and every
        scheduler's base LRs by ``factor``: a closed-form schedule (``LambdaLR``, the
        milestones of ``SequentialLR``) computes from the base LRs, a chainable one
        from the group's LR, so both keep the change for the rest of the run."""
        if factor == 1.0:
            return
        for opt in self.optimizers.values():
            for group in opt.param_groups:
                group["lr"] = group["lr"] * factor
                if "initial_lr" in group:
                    group["initial_lr"] = group["initial_lr"] * factor
        for sched in self.schedulers.values():
            for s in (sched, *getattr(sched, "_schedulers", ())):
                if hasattr(s, "base_lrs"):
                    s.base_lrs = [b * factor for b in s.base_lrs]
                if hasattr(s, "_last_lr"):
                    s._last_lr = [b * factor for b in s._last_lr]

    def monitor_registered(self) -> bool:
        r = self
        return bool(r.data or r.monitors or r.values)

    def contents(self, step: int) -> Checkpoint:
        """The container contents for ``step`` (live tensors: see :meth:`RunState.checkpoint`)."""
        r = self
        optim = {
            k: v
            for k, v in (
                (
                    "optimizers",
                    {n: r.access.optim_state(o, r.optimizer_models.get(n)) for n, o in r.optimizers.items()},
                ),
                ("schedulers", {n: s.state_dict() for n, s in r.schedulers.items()}),
                ("scalers", {n: s.state_dict() for n, s in r.scalers.items()}),
            )
            if v
        }
        monitor = {
            k: v
            for k, v in (
                ("data", {n: e.get() for n, e in r.data.items()}),
                ("monitors", {n: m.state_dict() for n, m in r.monitors.items()}),
                ("values", {n: e.get() for n, e in r.values.items()}),
            )
            if v
        }
        flags = 0
        for bit, name in FLAG_NAMES.items():
            if name in r.flags and r.flags[name].get():
                flags |= 1 << bit
        return Checkpoint(
            step=step,
            model={n: r.access.model_state(m) for n, m in r.models.items()} or None,
            optim=optim or None,
            teacher=None if r.teacher is None else r.access.model_state(r.teacher),
            monitor=monitor or None,
            flags=flags,
        )

    def check_contents(self, ckpt: Checkpoint, path: str) -> None:
        """Every registered piece is in the checkpoint and nothing unregistered is."""
        r = self
        problems: list[str] = []

        def compare(where: str, stored: Any, registered: Iterable[str]) -> None:
            have = set(stored or {})
            want = set(registered)
            if want - have:
                problems.append(f"{where} lacks {', '.join(sorted(want - have))}")
            if have - want:
                problems.append(
                    f"{where} carries {', '.join(sorted(map(str, have - want)))} that this run does not register"
                )

        compare("model section", ckpt.model, r.models)
        optim = ckpt.optim or {}
        for group, regs in (("optimizers", r.optimizers), ("schedulers", r.schedulers), ("scalers", r.scalers)):
            compare(f"optim[{group!r}]", optim.get(group), regs)
        if not ckpt.legacy:
            mon = ckpt.monitor or {}
            for group, regs in (("data", r.data), ("monitors", r.monitors), ("values", r.values)):
                compare(f"monitor[{group!r}]", mon.get(group), regs)
            if (ckpt.teacher is None) != (r.teacher is None):
                problems.append(
                    "teacher section is "
                    + (
                        "absent but a teacher is registered"
                        if ckpt.teacher is None
                        else "present but no teacher is registered"
                    )
                )
        if not problems:
            for name, m in r.models.items():
                _layout_problems(f"model[{name!r}]", ckpt.model[name], r.access.model_state(m), problems)
            if r.teacher is not None and ckpt.teacher is not None:
                _layout_problems("teacher", ckpt.teacher, r.access.model_state(r.teacher), problems)
        if problems:
            more = f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
            raise StateMismatch(
                f"{path}: does not match this run's registered state: " + "; ".join(problems[:10]) + more, problems
            )
        mon = ckpt.monitor or {}
        for name, entry in r.data.items():
            stored = mon.get("data", {}).get(name)
            if stored is not None:
                want = entry.expected_at(ckpt.step, mon.get("values") or {})
                if want is not None and stored != want:
                    raise StreamOffsetMismatch(
                        f"{path}: data position {name!r} is {stored}, but a run at step {ckpt.step} must be at {want}; "
                        "the stream offset rule changed or the checkpoint is from another run"
                    )

    def restore(self, ckpt: Checkpoint, *, sidecars: Mapping[str, tuple[int, Any]] | None, skip: Iterable[str]) -> None:
        """Put ``ckpt`` into the registered objects (see :meth:`RunState.restore`)."""
        r = self
        skip, sidecars = set(skip), dict(sidecars or {})
        self._check_request(skip, sidecars)

        def todo(kind: str, regs: Mapping[str, Any]) -> list[tuple[str, Any]]:
            return [(name, obj) for name, obj in regs.items() if f"{kind}:{name}" not in skip]

        for name, m in todo("model", r.models):
            r.access.load_model(m, ckpt.model[name])
        optim = ckpt.optim or {}
        for name, obj in todo("optimizer", r.optimizers):
            r.access.load_optim(obj, r.optimizer_models.get(name), optim["optimizers"][name])
        for group, kind, regs in (("schedulers", "scheduler", r.schedulers), ("scalers", "scaler", r.scalers)):
            for name, obj in todo(kind, regs):
                obj.load_state_dict(optim[group][name])
        if r.teacher is not None and ckpt.teacher is not None and "teacher:teacher" not in skip:
            r.access.load_model(r.teacher, ckpt.teacher)
            for p in r.teacher.parameters():
                p.requires_grad_(False)
        mon = ckpt.monitor or {}
        for name, m in todo("monitor", r.monitors):
            if "monitors" in mon:
                m.load_state_dict(mon["monitors"][name])
        for group, kind, regs in (("data", "data", r.data), ("values", "value", r.values)):
            for name, entry in todo(kind, regs):
                if group in mon:
                    entry.set(mon[group][name])
                elif ckpt.legacy and group == "data" and entry.expected_at(ckpt.step, {}) is not None:
                    entry.set(entry.expected_at(ckpt.step, {}))  # v1 stored no position: derive it from the rule
        for bit, name in FLAG_NAMES.items():
            if name in r.flags and f"flag:{name}" not in skip:
                r.flags[name].set(bool(ckpt.flags >> bit & 1))
        for kind, entry in todo("sidecar", r.sidecars):
            entry.set(sidecars[kind])

    def _check_request(self, skip: set[str], sidecars: Mapping[str, tuple[int, Any]]) -> None:
        """A restore's skip names and sidecar contents, checked before anything is loaded.

        Raises:
            ValueError: a skip name this run does not register, or a registered sidecar with no contents.
        """
        r = self
        groups: dict[str, Mapping[str, Any]] = {
            "model": r.models,
            "optimizer": r.optimizers,
            "scheduler": r.schedulers,
            "scaler": r.scalers,
            "teacher": {"teacher": r.teacher} if r.teacher is not None else {},
            "monitor": r.monitors,
            "data": r.data,
            "value": r.values,
            "flag": r.flags,
            "sidecar": r.sidecars,
        }
        unknown = sorted(s for s in skip if s.partition(":")[2] not in groups.get(s.partition(":")[0], {}))
        if unknown:
            raise ValueError(f"restore: skip names {', '.join(unknown)}, which this RunState does not register")
        lacking = sorted(k for k in r.sidecars if f"sidecar:{k}" not in skip and k not in sidecars)
        if lacking:
            raise ValueError(f"restore: no contents given for the registered sidecar(s) {', '.join(lacking)}")


def _layout_problems(where: str, stored: Mapping[str, Any], live: Mapping[str, Any], problems: list[str]) -> None:
    """Append how a module's stored state_dict differs from its live one in keys,
    shapes or dtypes (worded as ``load(into=...)`` words them): checked before
    anything is restored, so a model built differently (code changed, config
    not) is refused whole, not half-loaded."""
    import torch  # lazily: ``import ckptkit`` stays torch-free for the format tools

    from ..format._codec import dtype_name

    for key in sorted(set(live) | set(stored)):
        at = f"{where}[{key!r}]"
        if key not in stored:
            problems.append(f"{at}: missing from the checkpoint")
        elif key not in live:
            problems.append(f"{at}: in the checkpoint but not in the module")
        elif isinstance(a := stored[key], torch.Tensor) and isinstance(b := live[key], torch.Tensor):
            if a.dtype != b.dtype:
                problems.append(
                    f"{at}: dtype {dtype_name(a.dtype)} in the checkpoint, {dtype_name(b.dtype)} in the module"
                )
            elif a.shape != b.shape:
                problems.append(f"{at}: shape {list(a.shape)} in the checkpoint, {list(b.shape)} in the module")


def has_state_dict(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
