"""Plots of a run's recording (``history.jsonl``): loss, grad norm, spikes, rollbacks, LR, resumes.

    ckptkit plot runs/a -o runs/a.png
    ckptkit plot runs/a -o zoom.png --from 180 --to 220

Reads the recording through :mod:`ckptkit.run._history`, so it draws the reference
trainer's runs and the recordings of outside loops alike (the same row kinds;
their own scalar names). From ``step`` rows it draws every numeric field named
``loss*`` or ``*_loss`` (the total thicker), ``grad_norm`` and ``lr``; from
``rollback`` rows a band from the spiking step ``N`` back to the step ``T`` the
run restarted from, with the LR drop; from ``resume`` rows a dotted line; from
``resume_check`` rows a band at the foot over the steps a resume re-ran and proved.

The grad-norm threshold is not stored in the recording: it is recomputed with
ckptkit's own detector (:class:`~ckptkit.guard.SpikeMonitor`, spec/rollback.md
R-M03/R-M04), fed the recorded grad norms in file order. Before a step is observed
the detector's state is kept; a row whose step the detector has already passed
(a re-run, or the first step after a rollback) rewinds it to the state kept before
that step, as the trainer's ring restore does (R-M07). The line is
``max(floor, multiplier x lower median)`` once ``min_history`` values are in the
window. The spike config is the run's, read from its newest config snapshot's
``monitor`` table; without one, :class:`~ckptkit.guard.SpikeConfig`'s defaults.

Which rows the final state descends from (``kept_rows`` of spec/rollback.md R-R10):
a step row is abandoned when a ``spike`` row with action ``rerun``, ``rollback`` or
``unstable`` discards its update, and when its step is executed again (a re-run, or
the steps after a rollback) every row from that step on is abandoned. Kept rows are
drawn solid, abandoned ones faded.

matplotlib is an optional extra (``pip install 'ckptkit[plot]'``). It is imported
only when a plot is drawn, with a :class:`matplotlib.figure.Figure` and its Agg
canvas: no pyplot, no display, no global backend switch.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import math
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointNotFound, FormatError
from ..format._atomic import write_bytes_atomic
from ..guard._monitor import SpikeConfig, SpikeMonitor
from ..run._history import HISTORY_FILE, read_rows
from ..run._resume_check import CHECK_KIND

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["COLORS", "PLOT_EXTRA", "PlotSummary", "RunSeries", "plot_run", "read_series", "render", "spike_config_of"]

#: What to install when matplotlib is missing.
PLOT_EXTRA = "pip install 'ckptkit[plot]'"

#: One colour per series (tests look for these pixels in the PNG). Loss parts beyond
#: the first two take the ``extra`` colours in name order.
COLORS = {
    "loss": "#1f3b73",
    "part0": "#3a8dde",
    "part1": "#8e5bd1",
    "grad_norm": "#138a72",
    "threshold": "#f08c00",
    "spike": "#d62728",
    "rollback": "#e8a5a5",
    "lr": "#b5651d",
    "resume": "#5f6b7a",
    "resume_verified": "#2e8b57",
    "resume_differed": "#c0392b",
}
_EXTRA_COLORS = ("#2ca02c", "#17becf", "#bcbd22", "#7f7f7f")
_ABANDONED_ALPHA = 0.75  # abandoned steps must stand out against the rollback shading
_TRANSIENT = 0.1  # the loss axis is fitted to the run after its first 10% of steps (the start's transient)
_DEFAULTS = "SpikeConfig defaults"
# Spike actions after which the spiking step's update is discarded (spec/rollback.md R-R04, R-R07).
_DISCARDED = frozenset({"rerun", "rollback", "unstable"})
# Detector states kept for rewinds (each a copy of the window): a re-run or rollback further back than
# this many steps leaves the threshold of its rows undrawn.
_REWIND_LIMIT = 10_000
_LOSS_NAME = re.compile(r"^(loss.*|.+_loss)$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSeries:
    """What a plot of a recording draws, as plain values (no matplotlib).

    Attributes:
        steps: the step of every ``step`` row, in file order.
        kept: per row, whether the final state descends from it (else it was abandoned).
        scalars: per drawn name (``loss``, its parts, ``grad_norm``, ``lr``), one value per
            row (None where the row does not record it).
        threshold: per row, the detector's grad-norm threshold before the row's step was
            observed (None while warming up, or without grad norms).
        spikes: ``(step, grad_norm)`` of every row judged a spike (recorded ``spike``, or
            the detector's verdict for rows that do not record one).
        rollbacks: ``(N, T, lr_before, lr_after)`` per ``rollback`` row.
        spike_events: the spikes as a person counts them (and the trainer's summary): a
            spiking step and its spiking re-run from the state before it are one spike.
        resumes: the step of every ``resume`` row.
        checked: ``(first, last, verdict)`` per resume whose re-run steps were compared with the
            interrupted run's (``resume_check`` rows, spec/determinism.md R-D23): ``verified``
            over steps ``first..last``, or ``differed`` at step ``first`` (= ``last``).
        spike_config: the detector's parameters; config_source: where they came from.
    """

    steps: tuple[int, ...]
    kept: tuple[bool, ...]
    scalars: dict[str, tuple[float | None, ...]]
    threshold: tuple[float | None, ...]
    spikes: tuple[tuple[int, float], ...]
    rollbacks: tuple[tuple[int, int, float | None, float | None], ...]
    resumes: tuple[int, ...]
    spike_config: SpikeConfig
    config_source: str
    spike_events: int = 0
    checked: tuple[tuple[int, int, str], ...] = ()

    def kept_scalars(self) -> list[tuple[int, dict[str, float]]]:
        """``(step, {name: value})`` for every kept row, ascending: what to log to an experiment
        tracker (one value per step, the lineage of the final state). Names a row does not record
        are left out; a recorded non-finite value is kept (NaN, inf)."""
        out = []
        for i, (step, kept) in enumerate(zip(self.steps, self.kept, strict=True)):
            if kept:
                out.append((step, {n: x for n, v in self.scalars.items() if (x := v[i]) is not None}))
        return out

    @property
    def loss_names(self) -> list[str]:
        """The drawn loss series: ``loss`` first (when recorded), then its parts by name."""
        names = sorted(n for n in self.scalars if _LOSS_NAME.match(n))
        return sorted(names, key=lambda n: n != "loss")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlotSummary:
    """What :func:`plot_run` drew and where (the CLI prints it)."""

    path: str
    steps: int
    spikes: int
    rollbacks: int
    resumes: int
    series: tuple[str, ...]

    def describe(self) -> str:
        return (
            f"{self.path}: {self.steps} step rows, {self.spikes} spike(s), {self.rollbacks} rollback(s), "
            f"{self.resumes} resume(s); drew {', '.join(self.series)}"
        )


def _number(value: Any) -> float | None:
    """A recorded scalar as a float (``"NaN"``/``"Infinity"`` strings included); None if not one."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if value in ("NaN", "Infinity", "-Infinity"):
        return float(value)
    return None


def spike_config_of(run_dir: str | os.PathLike[str]) -> tuple[SpikeConfig, str]:
    """The run's spike config and where it came from.

    The newest ``*.config.json`` snapshot in ``run_dir`` whose ``monitor`` table holds
    exactly :class:`SpikeConfig`'s fields (the reference trainer's); otherwise the
    defaults (an outside loop's own spike config is not recorded where ckptkit can know it).

    Raises:
        FormatError: the snapshot is unreadable, or its monitor table is not a valid spike config.
    """
    from ..format._snapshot import read_snapshot

    run_dir = os.fspath(run_dir)
    names = sorted((n for n in os.listdir(run_dir) if n.endswith(".ckpt.config.json")), reverse=True)
    fields = {f.name for f in dataclasses.fields(SpikeConfig)}
    for name in names:
        path = os.path.join(run_dir, name)
        table = read_snapshot(path).config.get("monitor")
        if isinstance(table, dict) and set(table) == fields:
            try:
                return SpikeConfig(**table), name
            except (TypeError, ValueError) as e:
                raise FormatError(f"monitor table is not a spike config ({e})", path=path, field="monitor") from None
    return SpikeConfig(), _DEFAULTS


def read_series(
    rows: Sequence[dict[str, Any]], spike_config: SpikeConfig | None = None, config_source: str = ""
) -> RunSeries:
    """Turn history rows into the series a plot draws (see the module docstring for the rules).

    Args:
        rows: the recording's rows in file order (:func:`ckptkit.run.read_rows`).
        spike_config: the detector's parameters; ``SpikeConfig()`` if omitted.
        config_source: where ``spike_config`` came from; the legend says so when it is the defaults.
    """
    config = spike_config or SpikeConfig()
    config_source = config_source or ("given" if spike_config else _DEFAULTS)
    step_rows = [r for r in rows if r["kind"] == "step"]
    names = sorted(
        {
            k
            for r in step_rows
            for k, v in r.items()
            if (_LOSS_NAME.match(k) or k in ("grad_norm", "lr")) and _number(v) is not None
        }
    )
    threshold, spikes, events = _replay_detector(step_rows, config)
    rollbacks = tuple(
        (r["step"], r["to"], _number(r.get("lr_before")), _number(r.get("lr_after")))
        for r in rows
        if r["kind"] == "rollback" and isinstance(r.get("to"), int)
    )
    return RunSeries(
        steps=tuple(r["step"] for r in step_rows),
        kept=_kept(rows),
        scalars={n: tuple(_number(r.get(n)) for r in step_rows) for n in names},
        threshold=threshold,
        spikes=spikes,
        rollbacks=rollbacks,
        resumes=tuple(r["step"] for r in rows if r["kind"] == "resume"),
        checked=_checked(rows),
        spike_config=config,
        config_source=config_source,
        spike_events=events,
    )


def _checked(rows: Sequence[dict[str, Any]]) -> tuple[tuple[int, int, str], ...]:
    """The spans each resume's check covered (R-D23): verified ``from..to``, or the step that differed."""
    out = []
    for r in rows:
        if r["kind"] != CHECK_KIND:
            continue
        if r.get("verdict") == "verified" and isinstance(r.get("from"), int) and isinstance(r.get("to"), int):
            out.append((r["from"], r["to"], "verified"))
        elif r.get("verdict") == "differed" and isinstance(r.get("at"), int):
            out.append((r["at"], r["at"], "differed"))
    return tuple(out)


def _kept(rows: Sequence[dict[str, Any]]) -> tuple[bool, ...]:
    """Per step row, whether the final state descends from it (spec/rollback.md R-R10's ``kept_rows``)."""
    lineage: dict[int, int] = {}  # step -> index of the row the final state descends from
    i = -1
    for r in rows:
        if r["kind"] == "spike" and r.get("action") in _DISCARDED:
            lineage.pop(r["step"], None)  # the step's update was taken back on the spot
        if r["kind"] != "step":
            continue
        i += 1
        step = r["step"]
        for s in [s for s in lineage if s >= step]:  # executed again: what followed is abandoned
            del lineage[s]
        lineage[step] = i
    kept_rows = set(lineage.values())
    return tuple(j in kept_rows for j in range(i + 1))


def _replay_detector(
    step_rows: Sequence[dict[str, Any]], config: SpikeConfig
) -> tuple[tuple[float | None, ...], tuple[tuple[int, float], ...], int]:
    """The detector fed the recorded grad norms in file order, rewound where a step runs again.

    Returns:
        Per step row the threshold before its step was observed (None while warming up, without a
        grad norm, or with nothing to rewind to), ``(step, grad_norm)`` of every spike, and the
        spike events (a spike whose previous row was a spike of the same step is its re-run).
    """
    monitor = SpikeMonitor(dataclasses.replace(config, history=0))  # the detector only: no report to keep
    before: collections.OrderedDict[int, dict[str, Any]] = collections.OrderedDict()  # step -> state before it
    threshold: list[float | None] = []
    spikes: list[tuple[int, float]] = []
    events, spiked = 0, None  # spiked: the step of the previous row, when it was a spike
    last: int | None = None
    for r in step_rows:
        step = r["step"]
        g = _number(r.get("grad_norm"))
        if g is None:
            threshold.append(None)
            continue
        if last is not None and step <= last:
            if step not in before:
                threshold.append(None)  # nothing to rewind to (the recording does not start at 0)
                continue
            monitor.rewind(before[step])
        before[step] = monitor.state_dict()
        before.move_to_end(step)
        if len(before) > _REWIND_LIMIT:
            before.popitem(last=False)
        verdict = monitor.observe(
            step, grad_norm=max(g, 0.0) if not math.isnan(g) else g, loss=_number(r.get("loss")) or 0.0
        )
        last = step
        median = None if verdict.reason == "warming_up" else verdict.median  # None: the detector is not armed
        threshold.append(None if median is None else max(config.floor, config.multiplier * median))
        recorded = r.get("spike")
        if recorded if isinstance(recorded, bool) else verdict.is_spike:
            spikes.append((step, g))
            events += spiked != step  # a spiking re-run of the spiking step is the same spike
            spiked = step
        else:
            spiked = None
    return tuple(threshold), tuple(spikes), events


def _fitted(series: RunSeries, window: _Window) -> tuple[float, float] | None:
    """The loss axis's range over the shown rows after the first :data:`_TRANSIENT` of them,
    with a margin, when the transient would otherwise take more than half the height (the
    first steps' loss, several times the rest, is then drawn running off the top); else None."""
    values = [
        v
        for name in series.loss_names
        for v, shown in zip(series.scalars[name], window.shown, strict=True)
        if shown and v is not None and math.isfinite(v)
    ]
    rows = [v for v, shown in zip(series.scalars.get("loss", ()), window.shown, strict=True) if shown]
    skip = int(len(rows) * _TRANSIENT)
    later = [
        v
        for name in series.loss_names
        for v in [x for x, shown in zip(series.scalars[name], window.shown, strict=True) if shown][skip:]
        if v is not None and math.isfinite(v)
    ]
    if not values or not later:
        return None
    lo, hi, top = min(values), max(later), max(values)
    if top - lo <= 2 * (hi - lo):
        return None
    pad = 0.08 * (hi - lo or abs(hi) or 1.0)
    return lo - pad, hi + pad


def _runs(flags: Sequence[bool]) -> list[tuple[int, int]]:
    """``[start, end)`` index ranges of consecutive equal flags that are True."""
    out, start = [], None
    for i, f in enumerate([*flags, False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            out.append((start, i))
            start = None
    return out


def render(series: RunSeries, *, title: str = "", start: int | None = None, end: int | None = None) -> Figure:
    """Draw ``series`` into a new matplotlib figure (Agg; nothing is shown).

    Panels, top to bottom: loss and its parts; grad norm, its threshold and the spike
    markers (when grad norms are recorded); the LR with its drops (when recorded).
    Rollbacks are shaded ``[T, N]`` in every panel, resumes are dotted lines.
    Every artist has ``gid`` = its series key (``loss``, ``grad_norm``, ``threshold``,
    ``spike``, ``rollback``, ``lr``, ``lr_drop``, ``resume``, ``abandoned:NAME``, or a
    loss part's name) and a legend label.

    Args:
        series: from :func:`read_series`.
        title: the figure's title.
        start, end: draw only steps ``start <= step <= end``.

    Raises:
        ModuleNotFoundError: matplotlib is not installed (the message names the extra).
        ValueError: no step row lies in ``[start, end]``.
    """
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"plotting needs matplotlib: {PLOT_EXTRA}", name=e.name) from None

    window = _Window.of(series, start, end)
    heights = {"loss": 2.8, "grad_norm": 2.2, "lr": 1.4}  # inches per panel, plus 0.6 for the title and axis
    panels = ["loss"] if series.loss_names else []
    panels += [n for n in ("grad_norm", "lr") if n in series.scalars]
    fig = Figure(figsize=(11, 0.6 + sum(heights[p] for p in panels)), dpi=100, layout="constrained")
    grid = fig.subplots(len(panels), 1, sharex=True, squeeze=False, height_ratios=[heights[p] for p in panels])
    axes = list(grid[:, 0])
    painter = _Painter(series, window, _colors(series.loss_names))
    draw_panel = {"loss": painter.loss_panel, "grad_norm": painter.grad_norm_panel, "lr": painter.lr_panel}
    for panel, ax in zip(panels, axes, strict=True):
        draw_panel[panel](ax)
    painter.rollbacks(axes)
    painter.resumes(axes)
    painter.checked(axes)
    _finish(axes, window)
    if title:
        fig.suptitle(title, fontsize=11, x=0.01, ha="left")
    return fig


@dataclasses.dataclass(frozen=True)
class _Window:
    """The steps a figure shows (``lo <= step <= hi``) and its x axis."""

    lo: float
    hi: float
    shown: tuple[bool, ...]  # per step row: inside the window
    x0: float
    x1: float
    gap: float  # a label closer than this to the previous one is left out

    @classmethod
    def of(cls, series: RunSeries, start: int | None, end: int | None) -> _Window:
        """The window ``[start, end]`` (either end open when None) over ``series``' steps.

        Raises:
            ValueError: no step row lies in the window.
        """
        lo = -math.inf if start is None else start
        hi = math.inf if end is None else end
        shown = tuple(lo <= s <= hi for s in series.steps)
        if not any(shown):
            raise ValueError(
                f"no step rows in the range {start if start is not None else 'start'}.."
                f"{end if end is not None else 'end'} (the recording has steps "
                f"{min(series.steps, default=0)}..{max(series.steps, default=0)})"
            )
        xs = [s for s, v in zip(series.steps, shown, strict=True) if v]
        x0, x1 = (min(xs) if start is None else start), (max(xs) if end is None else end)
        return cls(lo, hi, shown, x0, x1, gap=0.07 * max(x1 - x0, 1))

    def __contains__(self, step: int) -> bool:
        return self.lo <= step <= self.hi


def _colors(loss_names: Sequence[str]) -> dict[str, str]:
    """A colour per drawn scalar: the loss parts take the palette in name order."""
    palette = (COLORS["part0"], COLORS["part1"], *_EXTRA_COLORS)
    colors = {n: palette[i % len(palette)] for i, n in enumerate(n for n in loss_names if n != "loss")}
    return colors | {"loss": COLORS["loss"], "grad_norm": COLORS["grad_norm"], "lr": COLORS["lr"]}


@dataclasses.dataclass(frozen=True)
class _Painter:
    """Draws one series' artists into the axes of a figure, restricted to a window."""

    series: RunSeries
    window: _Window
    colors: dict[str, str]

    def line(self, ax: Any, name: str, label: str, width: float, style: Any = "-") -> None:
        """A scalar: kept rows in ``style``, each run of abandoned rows dashed, as wide."""
        series = self.series
        values = [math.nan if v is None else v for v in series.scalars[name]]
        kept = [k and s for k, s in zip(series.kept, self.window.shown, strict=True)]
        abandoned = [not k and s for k, s in zip(series.kept, self.window.shown, strict=True)]
        xs = [st for st, k in zip(series.steps, kept, strict=True) if k]
        ys = [v for v, k in zip(values, kept, strict=True) if k]
        ax.plot(xs, ys, color=self.colors[name], lw=width, ls=style, label=label, gid=name, zorder=3)
        for j, (a, b) in enumerate(_runs(abandoned)):
            ax.plot(
                series.steps[a:b],
                values[a:b],
                color=self.colors[name],
                lw=max(width, 1.2),
                alpha=_ABANDONED_ALPHA,
                ls=(0, (2, 1.5)),
                gid=f"abandoned:{name}",
                zorder=2,
                label="abandoned (rolled back)" if j == 0 and name in ("loss", "grad_norm") else "_nolegend_",
            )

    def loss_panel(self, ax: Any) -> None:
        """The loss solid and wide, its parts thin and dash-dotted (a part that is nearly the
        whole loss stays visible over it); the axis fitted past the start's transient."""
        for n in self.series.loss_names:
            self.line(ax, n, n, 2.4 if n == "loss" else 1.2, "-" if n == "loss" else (0, (6, 2, 1, 2)))
        limits = _fitted(self.series, self.window)
        if limits is not None:
            ax.set_ylim(*limits)
        ax.set_ylabel("loss")

    def grad_norm_panel(self, ax: Any) -> None:
        """Grad norm on a log scale, the detector's threshold over the kept rows, the spikes."""
        from matplotlib.ticker import FuncFormatter, LogLocator

        series, window = self.series, self.window
        self.line(ax, "grad_norm", "grad norm (pre-clip)", 1.5)
        cfg = series.spike_config
        drawn = [
            (s, t)
            for s, t, v, k in zip(series.steps, series.threshold, window.shown, series.kept, strict=True)
            if v and k and t is not None
        ]
        tx, ty = [d[0] for d in drawn], [d[1] for d in drawn]
        if tx:
            source = "" if series.config_source != _DEFAULTS else f"; {_DEFAULTS}"
            ax.plot(
                tx,
                ty,
                color=COLORS["threshold"],
                lw=1.6,
                ls=(0, (4, 2)),
                gid="threshold",
                zorder=4,
                label=f"threshold: {cfg.multiplier:g}x rolling median ({cfg.window} steps{source})",
            )
        pts = [(s, g) for s, g in series.spikes if s in window and math.isfinite(g)]
        if pts:
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                ls="none",
                marker="X",
                ms=9,
                mec="white",
                mew=0.8,
                color=COLORS["spike"],
                gid="spike",
                zorder=6,
                clip_on=False,
                label="spike",
            )
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.set_ylabel("grad norm")

    def lr_panel(self, ax: Any) -> None:
        """The LR, with a marker and its factor (``x0.5``) where a rollback dropped it."""
        window = self.window
        self.line(ax, "lr", "learning rate", 1.6)
        drops = [(t, after) for n, t, before, after in self.series.rollbacks if t in window and after is not None]
        if drops:
            ax.plot(
                [d[0] for d in drops],
                [d[1] for d in drops],
                ls="none",
                marker="v",
                ms=8,
                color=COLORS["spike"],
                gid="lr_drop",
                zorder=6,
                label="LR drop at rollback",
            )
            labelled = -math.inf
            for _n, t, before, after in self.series.rollbacks:
                if t in window and before and after and t - labelled >= window.gap:
                    labelled = t
                    ax.annotate(
                        f"\u00d7{after / before:.3g}",
                        (t, after),
                        textcoords="offset points",
                        xytext=(8, 4),
                        fontsize=8,
                        color=COLORS["spike"],
                    )
        ax.set_ylabel("LR")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))

    def rollbacks(self, axes: Sequence[Any]) -> None:
        """Each rollback ``N -> T``: a band ``[T, N+1]`` in every panel, an arrow and a label on top."""
        window = self.window
        labelled = -math.inf
        for k, (spike, t, _b, _a) in enumerate(self.series.rollbacks):
            if spike < window.lo or t > window.hi:
                continue
            for ax in axes:
                ax.axvspan(
                    t,
                    spike + 1,
                    color=COLORS["rollback"],
                    alpha=0.45,
                    lw=0,
                    zorder=1,
                    gid="rollback",
                    label="rollback: step N back to N-K" if k == 0 and ax is axes[0] else "_nolegend_",
                )
            top = axes[0]
            y = top.get_ylim()[1]
            top.annotate(
                "",
                xy=(t, y),
                xytext=(spike + 1, y),
                annotation_clip=False,
                arrowprops={"arrowstyle": "-|>", "color": COLORS["spike"], "lw": 1.4},
            )
            if t - labelled < window.gap:
                continue
            labelled = t
            top.annotate(
                f"{spike}\u2192{t}",
                (t, y),
                textcoords="offset points",
                xytext=(0, 4),
                fontsize=8,
                color=COLORS["spike"],
                annotation_clip=False,
            )

    def resumes(self, axes: Sequence[Any]) -> None:
        """A dotted line across every panel at each resume."""
        for k, s in enumerate(x for x in self.series.resumes if x in self.window):
            for ax in axes:
                ax.axvline(
                    s,
                    color=COLORS["resume"],
                    lw=2.0,
                    ls=(0, (3, 2)),
                    gid="resume",
                    zorder=5,
                    label="resume" if k == 0 and ax is axes[0] else "_nolegend_",
                )

    def checked(self, axes: Sequence[Any]) -> None:
        """A band over the steps each resume re-ran and compared: green where they reproduced the
        interrupted run bit for bit, red at the step where they differed (R-D23)."""
        seen: set[str] = set()
        for first, last, verdict in self.series.checked:
            if last < self.window.lo or first > self.window.hi:
                continue
            for ax in axes:
                ax.axvspan(
                    first,
                    last + 1,
                    ymin=0.0,
                    ymax=0.04,
                    color=COLORS[f"resume_{verdict}"],
                    lw=0,
                    zorder=6,
                    gid=f"resume_{verdict}",
                    label=f"resume {verdict}" if verdict not in seen and ax is axes[0] else "_nolegend_",
                )
            seen.add(verdict)


def _finish(axes: Sequence[Any], window: _Window) -> None:
    """Grid, open top/right spines, each panel's legend beside it, the shared step axis."""
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        ax.grid(True, color="#e6e6e6", lw=0.8)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        handles, labels = ax.get_legend_handles_labels()
        if handles:  # beside the panel, never over the data
            ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].set_xlim(window.x0, window.x1)


def plot_run(
    run: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    start: int | None = None,
    end: int | None = None,
    spike_config: SpikeConfig | None = None,
) -> PlotSummary:
    """Render a run's recording to an image file (PNG, or any format matplotlib writes).

    Args:
        run: the run directory, or a ``history.jsonl`` file.
        out: the image to write (its suffix picks the format).
        start, end: draw only steps ``start <= step <= end``.
        spike_config: the detector's parameters; default: the run's (:func:`spike_config_of`).

    Returns:
        A :class:`PlotSummary`.

    Raises:
        CheckpointNotFound: ``run`` has no ``history.jsonl``.
        FormatError: a line of the recording is not a history row.
        ValueError: the recording has no step row with a loss, grad norm or LR in the range,
            or matplotlib does not write ``out``'s format.
        SaveFailed: the image could not be written (a previous file at ``out`` is intact).
        ModuleNotFoundError: matplotlib is missing (the message names the extra).

    Example:
        >>> plot_run("runs/a", "runs/a.png").describe()  # doctest: +SKIP
        'runs/a.png: 300 step rows, 1 spike(s), 1 rollback(s), 0 resume(s); drew loss, ...'
    """
    run = os.fspath(run)
    path = run if os.path.isfile(run) else os.path.join(run, HISTORY_FILE)
    if not os.path.isfile(path):
        raise CheckpointNotFound(f"{run}: no {HISTORY_FILE} here (a run directory, or its {HISTORY_FILE})")
    rows, _torn = read_rows(path)
    source = "given"
    if spike_config is None:
        spike_config, source = spike_config_of(os.path.dirname(path) or ".")
    series = read_series(rows, spike_config, source)
    if not series.scalars:
        raise ValueError(f"{path}: no step row records a loss, grad_norm or lr; nothing to plot")
    name = os.path.basename(os.path.normpath(os.path.dirname(path) or os.getcwd()))
    title = (
        f"{name}: {len(set(series.steps))} steps \u00b7 {series.spike_events} spike(s) \u00b7 "
        f"{len(series.rollbacks)} rollback(s) \u00b7 {len(series.resumes)} resume(s)"
    )
    fig = render(series, title=title, start=start, end=end)
    out = os.fspath(out)
    image = io.BytesIO()
    fig.savefig(image, format=os.path.splitext(out)[1][1:].lower() or "png", dpi=100)
    write_bytes_atomic(out, image.getvalue())  # the image appears whole or not at all
    drawn = sorted({str(a.get_gid()) for ax in fig.axes for a in [*ax.lines, *ax.patches] if a.get_gid()})
    return PlotSummary(
        path=out,
        steps=len(series.steps),
        spikes=series.spike_events,
        rollbacks=len(series.rollbacks),
        resumes=len(series.resumes),
        series=tuple(drawn),
    )
