"""What a run consists of: the ``add_*`` calls that tell a :class:`~ckptkit.RunState` its state.

Each registration is checked when it is made — a name taken twice, an object with no
``state_dict``, state the run's store could not carry — so that a run is refused
before it trains, never at its first save (spec/runstate.md "Registration").
:class:`Registration` is the part of :class:`~ckptkit.RunState` that registers;
what is registered lives in its :class:`~ckptkit.run._registry.Registry`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import UnsupportedValue
from ..format._checks import is_int
from ..format._container import FLAG_NAMES
from ..format._section import check_plain
from ..format._sidecar import sidecar_path
from ..format._values import NO_TENSORS
from ._loader import StatefulLoader, is_stateful_loader
from ._registry import Entry, Registry, has_state_dict
from ._store import Store

__all__ = ["Registration"]


class Registration:
    """The registering half of :class:`~ckptkit.RunState`."""

    _reg: Registry
    _store: Store
    _after_restore: list[Callable[[], None]]

    def _stateful(self, kind: str, name: str, obj: Any, taken: dict[str, Any]) -> None:
        self._reg.check_name(kind, name, taken)
        if not has_state_dict(obj):
            raise UnsupportedValue(f"{kind} {name!r}: a {type(obj).__name__} has no state_dict()/load_state_dict()")
        self._store.refuse_unstorable(kind, name, obj)  # refused at registration, not at the first save
        taken[name] = obj

    def add_model(self, name: str, module: Any) -> None:
        """Register a module; its ``state_dict()`` goes in the model section."""
        self._stateful("model", name, module, self._reg.models)

    def add_optimizer(self, name: str, optimizer: Any, *, model: str | None = None) -> None:
        """Register an optimizer (moments, step counters, param groups).

        Args:
            model: the registered model it optimizes; a distributed run saves the
                optimizer's state by that model's parameter names. May be omitted
                when exactly one model is registered.
        """
        if model is None and len(self._reg.models) == 1:
            model = next(iter(self._reg.models))
        if model is not None and model not in self._reg.models:
            raise ValueError(f"optimizer {name!r}: model {model!r} is not registered (add_model it first)")
        if model is None and self._store.names_optimizer_models:
            raise ValueError(f"optimizer {name!r}: name its model (model=...): {len(self._reg.models)} are registered")
        self._stateful("optimizer", name, optimizer, self._reg.optimizers)
        if model is not None:
            self._reg.optimizer_models[name] = self._reg.models[model]

    def add_scheduler(self, name: str, scheduler: Any) -> None:
        """Register an LR scheduler (or anything with ``state_dict``) in the optim section."""
        self._stateful("scheduler", name, scheduler, self._reg.schedulers)

    def add_scaler(self, name: str, scaler: Any) -> None:
        """Register a gradient scaler (``torch.amp.GradScaler``) in the optim section."""
        self._stateful("scaler", name, scaler, self._reg.scalers)

    def add_teacher(self, module: Any) -> None:
        """Register the EMA teacher: saved as the run left it, restored frozen.

        The teacher is never rebuilt from the student on resume (design record item 1).
        """
        if self._reg.teacher is not None:
            raise ValueError("a teacher is already registered")
        self._stateful("teacher", "teacher", module, {})
        self._reg.teacher = module

    def add_monitor(self, name: str, monitor: Any) -> None:
        """Register a monitor (e.g. :class:`ckptkit.guard.SpikeMonitor`); plain-value state only."""
        self._reg.check_name("monitor", name, self._reg.monitors)
        if not has_state_dict(monitor):
            raise UnsupportedValue(
                f"monitor {name!r}: a {type(monitor).__name__} has no state_dict()/load_state_dict()"
            )
        check_plain(monitor.state_dict(), f"monitor {name!r}")
        self._reg.monitors[name] = monitor

    def add_data_position(
        self,
        name: str,
        *,
        get: Callable[[], int],
        set: Callable[[int], None],  # noqa: A002 - mirrors property naming
        expected: Callable[[int, Mapping[str, Any]], int] | None = None,
    ) -> None:
        """Register a data-stream position (e.g. a byte offset).

        Args:
            get / set: read and restore the position.
            expected: the offset rule, ``expected(step, values)``: the position the
                run must be at after ``step`` steps. Resume refuses a checkpoint whose
                stored position differs (:class:`~ckptkit.errors.StreamOffsetMismatch`,
                design record item 6). ``values`` are the checkpoint's stored
                :meth:`add_value` values by name (``{}`` for a legacy checkpoint), read
                before anything is restored, for a rule that depends on run state:
                e.g. a trainer that skips batches after a spike rollback stores the
                count with ``add_value`` and its rule adds it. A plain rule ignores
                them: ``expected=lambda step, _values: step * batch * seq_len``.
        """
        self._reg.check_name("data position", name, self._reg.data)
        pos = get()
        if not is_int(pos):
            raise UnsupportedValue(f"data position {name!r} must be a non-negative int (got {pos!r})")
        self._reg.data[name] = Entry(get, set, expected)

    def add_value(
        self,
        name: str,
        *,
        get: Callable[[], Any],
        set: Callable[[Any], None],  # noqa: A002
        per_rank: bool = False,
    ) -> None:
        """Register small run state: plain values (numbers, str, lists, dicts) or typed values
        (``np.random.get_state()``, numpy scalars, sets; spec/container.md §5.4), each restored
        as the same type.

        Args:
            per_rank: each rank of a distributed run holds its own value (saved under
                its rank); otherwise the value is replicated, and a save refuses ranks
                whose copies differ. No effect in one process.
        """
        self._reg.check_name("value", name, self._reg.values)
        try:
            check_plain(get(), f"value {name!r}")
        except UnsupportedValue as e:
            if NO_TENSORS not in str(e):
                raise
            raise UnsupportedValue(f"{e}, or register the object whose state it is with add_stateful") from None
        self._reg.values[name] = Entry(get, set, per_rank=per_rank)

    def add_stateful(self, name: str, obj: Any) -> None:
        """Register any object with ``state_dict()`` / ``load_state_dict()``: torchdata's
        ``StatefulDataLoader``, a resumable sampler, a counter. Its state may hold tensors
        (a ``torch.Generator`` state is a ``uint8`` tensor) as well as plain values; it is
        stored as the value ``name`` (``values.<name>`` in the monitor section, its tensors
        in that section's data) and restored with ``load_state_dict``. A ``StatefulDataLoader``
        also keeps its generators and comes back where the uninterrupted loader was, at an
        epoch's end too (:mod:`~ckptkit.run._loader`, spec/runstate.md RS-3a).

        Raises:
            UnsupportedValue: the object has no ``state_dict``/``load_state_dict``, or its
                state holds something the container cannot carry (named by path); in a
                distributed run, a state holding tensors (replicated values are plain); a
                ``StatefulDataLoader`` whose order comes from a torch sampler that keeps no state.
        """
        if not has_state_dict(obj):
            raise UnsupportedValue(f"stateful {name!r}: a {type(obj).__name__} has no state_dict()/load_state_dict()")
        self._reg.check_name("value", name, self._reg.values)
        if is_stateful_loader(obj):
            obj = StatefulLoader(name, obj)
        self._store.refuse_unstorable("stateful", name, obj)  # refused at registration, not at the first save
        self._reg.values[name] = Entry(obj.state_dict, obj.load_state_dict)

    def add_flag(self, name: str, *, get: Callable[[], bool], set: Callable[[bool], None]) -> None:  # noqa: A002
        """Register a container flag bit by name (``fp32_fallback`` = bit 0)."""
        if name not in FLAG_NAMES.values():
            raise UnsupportedValue(
                f"flag {name!r} has no bit in this container version "
                f"(known: {', '.join(FLAG_NAMES.values())}); store it with add_value"
            )
        self._reg.check_name("flag", name, self._reg.flags)
        self._reg.flags[name] = Entry(get, set)

    def add_sidecar(
        self,
        kind: str,
        *,
        get: Callable[[], tuple[int, Any]],
        set: Callable[[int, Any], None],  # noqa: A002
    ) -> None:
        """Register a sidecar written next to every checkpoint as ``<ckpt>.<kind>``.

        Args:
            get: returns ``(table_step, tree)``.
            set: receives ``(table_step, tree)`` on restore.
        """
        sidecar_path("x", kind)  # validates the kind
        self._reg.check_name("sidecar", kind, self._reg.sidecars)
        _table_step, tree = get()
        from ..format._codec import encode_tree

        encode_tree(tree, f"sidecar {kind!r}")  # refused at registration, not at the first save
        self._reg.sidecars[kind] = Entry(get, lambda v: set(*v))

    def after_restore(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` after every restore: re-apply compute settings (quant format,
        latched fallbacks) that ``load_state_dict`` does not carry (design record item 2)."""
        self._after_restore.append(fn)

    def sidecar_contents(self) -> dict[str, tuple[int, Any]]:
        """``kind -> (table_step, tree)`` of every registered sidecar, as :meth:`restore` takes them
        (the live trees: copy them to keep this state while training goes on)."""
        return {kind: entry.get() for kind, entry in self._reg.sidecars.items()}
