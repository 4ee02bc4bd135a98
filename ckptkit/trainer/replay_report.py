"""What a replay found: where it parted from the recording, as text and as JSON.

The replayer (:mod:`ckptkit.trainer.replay`) and the two-run audit
(:mod:`ckptkit.trainer.audit`) build these; ``ckptkit replay`` prints
:meth:`ReplayReport.describe` or, with ``--json``, :meth:`ReplayReport.to_json`
(spec/replay.md R-P09). Tensors are listed in the order a step computes them
(gradients, parameters, optimizer state, teacher, monitor, header), so the first
one listed is where to look.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ReplayDivergence
from ..run.difference import Difference, FieldDiff, show
from ..run.environment import EnvDiff

__all__ = ["ReplayReport"]

JSON_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class ReplayReport:
    """What :func:`replay` found; ``ok`` when every step matched bit for bit."""

    run_dir: str
    checkpoint: str
    start: int  # steps done at the checkpoint replay started from
    to: int  # steps done when the replay stops (when it does not diverge)
    replayed: int  # steps re-run
    overrides: tuple[FieldDiff, ...] = ()
    environment: tuple[EnvDiff, ...] = ()
    notes: tuple[str, ...] = ()
    divergence: Difference | None = None
    guarded: bool = False  # replayed through rollbacks by the guarded loop (R-P15): executions, rows compared

    @property
    def ok(self) -> bool:
        """Every replayed step matched the recording bit for bit."""
        return self.divergence is None

    def raise_for_divergence(self) -> None:
        """Raise :class:`~ckptkit.errors.ReplayDivergence` (message: :meth:`describe`) unless ``ok``.

        Raises:
            ReplayDivergence: the replay diverged.
        """
        if self.divergence is not None:
            raise ReplayDivergence(self.describe())

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object (spec/replay.md R-P09)."""
        d = self.divergence
        return {
            "schema_version": JSON_SCHEMA_VERSION,
            "ok": self.ok,
            "run": self.run_dir,
            "checkpoint": self.checkpoint,
            "from": self.start,
            "to": self.to,
            "steps_replayed": self.replayed,
            "guarded": self.guarded,
            "overrides": [{"field": f.field, "snapshot": f.recorded, "replay": f.replayed} for f in self.overrides],
            "environment": [
                {"key": e.key, "recorded": e.recorded, "current": e.current, "fatal": e.fatal} for e in self.environment
            ],
            "notes": list(self.notes),
            "divergence": None if d is None else d.to_json(),
        }

    def describe(self, limit: int = 12) -> str:
        """The human report (what ``ckptkit replay`` prints on stdout)."""
        lines = [f"replay: {self.checkpoint} (step {self.start}) -> step {self.to}"]
        for o in self.overrides:
            lines.append(f"override: {o.field}: snapshot {show(o.recorded)}, replay {show(o.replayed)}")
        fatal = [e for e in self.environment if e.fatal]
        if fatal:
            lines.append(f"environment: differs from the recording in {len(fatal)} fact(s):")
            lines += [f"  {e}" for e in fatal]
        else:
            lines.append("environment: as recorded")
        lines += [f"note: {n}" for n in self.notes]
        d = self.divergence
        if d is None:
            span = f"steps {self.start}..{self.to - 1}" if self.replayed else "no steps"
            what = (
                "step execution(s) replayed through the recorded re-runs and rollbacks"
                if self.guarded
                else "step(s) replayed"
            )
            lines.append(f"IDENTICAL: {self.replayed} {what} ({span}), every fingerprint bit for bit")
            return "\n".join(lines)
        lines.append(self._divergence_headline(d))
        lines += d.lines(against=" from the recording", limit=limit)
        return "\n".join(lines)

    def _divergence_headline(self, d: Difference) -> str:
        """The ``DIVERGED at step N`` line: what differed, as the divergence's kind and the replay's mode say."""
        if d.kind == "checkpoint" and self.guarded:
            return f"DIVERGED at step {d.step}: {d.file} differs from the file the replay wrote at that step"
        if d.kind == "checkpoint":
            return (
                f"DIVERGED at step {d.step}: {d.file} does not match the digests recorded when it was "
                "written (altered after the fact)"
            )
        if self.guarded:
            return (
                f"DIVERGED at step {d.step}: the recording's history row differs from the replay's "
                f"({d.kind}; the rows before it matched)"
            )
        if d.kind == "state":
            return (
                f"DIVERGED at step {d.step}: the state after {d.step} steps differs from the recorded "
                "checkpoint digests"
            )
        return f"DIVERGED at step {d.step} (history row step={d.step}; {self.replayed - 1} step(s) before it matched)"
