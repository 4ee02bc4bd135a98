"""``ckptkit plot``: real runs rendered, the image checked (size, artists, pixel colours).

The runs are short ``ckptkit train`` runs of the tiny config: one plain, one with
``--auto-rollback on --spike-at 9`` (one rollback, 9 -> 6) interrupted at step 7
and resumed. The grad-norm threshold is checked against the trainer's own recorded
verdicts, and the kept rows against ``kept_rows`` (spec/rollback.md R-R10).
"""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import TINY_FLAGS
from matplotlib.patches import Rectangle

from ckptkit.audit._plot import COLORS, plot_run, read_series, render, spike_config_of
from ckptkit.cli import main
from ckptkit.guard._monitor import SpikeConfig
from ckptkit.run._history import History, read_rows

pytestmark = pytest.mark.slow

TINY = [*TINY_FLAGS, "--log-every", "1000", "--keep", "100", "--quiet"]
ROLLBACK = [
    "--spike-window",
    "8",
    "--spike-min-history",
    "4",
    "--auto-rollback",
    "on",
    "--rollback-k",
    "3",
    "--ckpt-every",
    "3",
    "--spike-at",
    "9",
]


def train(run_dir: Path, *flags: str) -> None:
    assert main(["train", "--run-dir", str(run_dir), *TINY, *flags]) == 0


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("plain") / "run"
    train(d, "--steps", "24")
    return d


@pytest.fixture(scope="module")
def rolled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A spike at 9 rolled back to 6; the run was stopped at 7 and resumed to 14."""
    d = tmp_path_factory.mktemp("rolled") / "run"
    train(d, *ROLLBACK, "--steps", "7")
    train(d, *ROLLBACK, "--steps", "14", "--resume")
    return d


def rows_of(run_dir: Path) -> list[dict[str, Any]]:
    return read_rows(run_dir / "history.jsonl")[0]


def gids(fig: Any) -> set[str]:
    return {str(a.get_gid()) for ax in fig.axes for a in [*ax.lines, *ax.patches] if a.get_gid()}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def pixels_near(path: Path, color: str, alpha: float = 1.0, tol: int = 6) -> int:
    """Pixels of the PNG within ``tol`` (per channel, 0..255) of ``color`` drawn at ``alpha`` over white."""
    import matplotlib.image
    import numpy as np

    img = (matplotlib.image.imread(str(path))[..., :3] * 255).round()
    rgb = np.array([int(color[i : i + 2], 16) for i in (1, 3, 5)], dtype=float)
    want = alpha * rgb + (1 - alpha) * 255
    return int((np.abs(img - want) <= tol).all(axis=-1).sum())


# ----------------------------------------------------------------------------- the CLI renders real runs


def test_plot_of_a_run_with_a_rollback_and_a_resume_draws_every_series(
    rolled: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rolled.png"
    assert main(["plot", str(rolled), "-o", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{out}: ") and "1 rollback(s), 1 resume(s)" in line
    assert png_size(out) == (1100, 700)  # 11 x 7 inches at 100 dpi: three panels
    assert 20_000 < out.stat().st_size < 400_000
    for series in ("loss", "part0", "part1", "grad_norm", "threshold", "spike", "lr", "resume"):
        assert pixels_near(out, COLORS[series]) >= 20, series
    assert pixels_near(out, COLORS["rollback"], alpha=0.45, tol=3) >= 2000  # the shaded band 6..9


def test_plot_of_a_plain_run_has_no_rollback_spike_or_resume(plain: Path, tmp_path: Path) -> None:
    out = tmp_path / "plain.png"
    assert main(["plot", str(plain), "-o", str(out)]) == 0
    for series in ("loss", "part0", "part1", "grad_norm", "threshold", "lr"):
        assert pixels_near(out, COLORS[series]) >= 20, series
    for series in ("spike", "resume"):
        assert pixels_near(out, COLORS[series]) == 0, series
    assert pixels_near(out, COLORS["rollback"], alpha=0.45, tol=3) == 0


def test_the_figure_names_each_series_it_draws(rolled: Path, plain: Path) -> None:
    from matplotlib.patches import Rectangle

    cfg, source = spike_config_of(rolled)
    assert (cfg.window, cfg.min_history, source) == (8, 4, "step-00000014.ckpt.config.json")
    fig = render(read_series(rows_of(rolled), cfg))
    assert gids(fig) == {
        "loss",
        "lm_loss",
        "aux_loss",
        "grad_norm",
        "threshold",
        "spike",
        "rollback",
        "lr",
        "lr_drop",
        "resume",
        "abandoned:loss",
        "abandoned:lm_loss",
        "abandoned:aux_loss",
        "abandoned:grad_norm",
        "abandoned:lr",
    }
    labels = {t.get_text() for ax in fig.axes if (legend := ax.get_legend()) for t in legend.get_texts()}
    assert {
        "loss",
        "lm_loss",
        "aux_loss",
        "grad norm (pre-clip)",
        "threshold: 3x rolling median (8 steps)",
        "spike",
        "rollback: step N back to N-K",
        "resume",
        "learning rate",
        "LR drop at rollback",
    } <= labels
    band = next(p for ax in fig.axes for p in ax.patches if p.get_gid() == "rollback")
    assert isinstance(band, Rectangle)  # what axvspan draws (matplotlib >= 3.9)
    xs = [band.get_x(), band.get_x() + band.get_width()]
    assert (min(xs), max(xs)) == (6, 10)  # from the restart step T = 6 to the spiking step N = 9 inclusive
    assert gids(render(read_series(rows_of(plain), spike_config_of(plain)[0]))) == {
        "loss",
        "lm_loss",
        "aux_loss",
        "grad_norm",
        "threshold",
        "lr",
    }


def test_the_threshold_is_the_trainers_own_detector(rolled: Path, plain: Path) -> None:
    """Every recorded verdict is reproduced: spike iff grad norm > the drawn threshold."""
    for run in (rolled, plain):
        rows = rows_of(run)
        series = read_series(rows, spike_config_of(run)[0])
        steps = [r for r in rows if r["kind"] == "step"]
        assert len(steps) == len(series.threshold)
        for r, t in zip(steps, series.threshold, strict=True):
            assert (r["verdict"] == "warming_up") == (t is None), r["step"]
            if t is not None:
                assert r["spike"] == (r["grad_norm"] > t), r["step"]


def test_the_kept_rows_are_the_trainers_lineage(rolled: Path) -> None:
    from ckptkit.run._history import kept_rows

    rows = rows_of(rolled)
    series = read_series(rows)
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r for r, k in zip(steps, series.kept, strict=True) if k] == kept_rows(rows)
    assert series.rollbacks[0][:2] == (9, 6)
    assert series.resumes == (7,)  # the run stopped at 7 wrote checkpoint 7


def test_json_names_what_was_drawn(plain: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    out = tmp_path / "p.png"
    assert main(["plot", str(plain), "-o", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "schema_version": 1,
        "path": str(out),
        "steps": 24,
        "spikes": 0,
        "rollbacks": 0,
        "resumes": 0,
        "series": ["aux_loss", "grad_norm", "lm_loss", "loss", "lr", "threshold"],
    }


def test_from_and_to_zoom_the_step_axis(rolled: Path, tmp_path: Path) -> None:
    fig = render(read_series(rows_of(rolled)), start=4, end=11)
    assert fig.axes[-1].get_xlim() == (4, 11)
    out = tmp_path / "zoom.png"
    assert main(["plot", str(rolled), "-o", str(out), "--from", "4", "--to", "11"]) == 0
    assert png_size(out) == (1100, 700)


# ----------------------------------------------------------------------------- outside loops' recordings


def test_an_outside_loops_recording_is_drawn_with_its_own_scalar_names(tmp_path: Path) -> None:
    h = History(tmp_path)
    h.start_fresh()
    for step in range(30):
        g = 40.0 if step == 20 else 1.0 + 0.01 * (step % 3)
        h.append(
            {
                "kind": "step",
                "step": step,
                "loss": 2.0 - step / 30,
                "loss_ce": 1.5 - step / 40,
                "grad_norm": g,
                "lr": 1e-3,
                "tokens": step * 512,
            }
        )
    h.append({"kind": "resume", "step": 25})
    h.close()
    out = tmp_path / "loop.png"
    summary = plot_run(tmp_path, out)
    assert summary.series == ("grad_norm", "loss", "loss_ce", "lr", "resume", "spike", "threshold")
    assert summary.spikes == 1  # the detector's verdict: the loop records no `spike` field
    assert pixels_near(out, COLORS["part0"]) >= 20  # loss_ce, the first part
    fig = render(read_series(read_rows(tmp_path / "history.jsonl")[0]))
    threshold = next(line for ax in fig.axes for line in ax.lines if line.get_gid() == "threshold")
    assert threshold.get_label() == "threshold: 3x rolling median (50 steps; SpikeConfig defaults)"


def test_a_recording_of_losses_only_is_one_panel(tmp_path: Path) -> None:
    h = History(tmp_path)
    h.start_fresh()
    for step in range(5):
        h.append({"kind": "step", "step": step, "loss": 1.0 / (step + 1), "loss_bits": "0x0"})
    h.close()
    fig = render(read_series(read_rows(tmp_path / "history.jsonl")[0]))
    assert len(fig.axes) == 1 and gids(fig) == {"loss"}


def test_a_rerun_row_is_judged_from_the_state_before_its_step() -> None:
    """R-M07: the detector rewinds for a re-run, so the re-run is judged against the same median."""
    rows = [{"kind": "step", "step": s, "grad_norm": 1.0, "loss": 1.0} for s in range(4)]
    rows += [
        {"kind": "step", "step": 4, "grad_norm": 50.0, "loss": 1.0},
        {"kind": "spike", "step": 4, "action": "rerun"},
        {"kind": "step", "step": 4, "grad_norm": 2.0, "loss": 1.0, "rerun": True},
        {"kind": "step", "step": 5, "grad_norm": 1.0, "loss": 1.0},
    ]
    series = read_series(rows, SpikeConfig(window=4, min_history=4))
    assert series.threshold[-3:] == (3.0, 3.0, 3.0)  # 3 x lower median of [1, 1, 1, 1], then of [1, 1, 1, 2]
    assert series.spikes == ((4, 50.0),)
    assert series.kept == (True,) * 4 + (False, True, True)


# ----------------------------------------------------------------------------- errors


def test_a_directory_without_a_recording_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    assert (
        capsys.readouterr().err
        == f"ckptkit plot: {tmp_path}: no history.jsonl here (a run directory, or its history.jsonl)\n"
    )


def test_an_empty_range_and_a_reversed_range_are_usage_errors(
    rolled: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.png"
    assert main(["plot", str(rolled), "-o", str(out), "--from", "50"]) == 2
    assert (
        capsys.readouterr().err == "ckptkit plot: no step rows in the range 50..end (the recording has steps 0..13)\n"
    )
    assert main(["plot", str(rolled), "-o", str(out), "--from", "9", "--to", "3"]) == 2
    assert capsys.readouterr().err == "ckptkit plot: --from 9 is after --to 3\n"
    assert not out.exists()


def test_an_unwritable_output_is_one_line(plain: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "missing" / "x.png"
    assert main(["plot", str(plain), "-o", str(out)]) == 2
    assert capsys.readouterr().err.startswith(f"ckptkit plot: {out}: the folder {out.parent} does not exist; create it")
    assert main(["plot", str(plain), "-o", str(tmp_path / "x.nope")]) == 2
    assert capsys.readouterr().err.startswith("ckptkit plot: Format 'nope' is not supported (supported formats: ")
    assert os.listdir(tmp_path) == []


def test_a_recording_without_scalars_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    h = History(tmp_path)
    h.start_fresh()
    h.append({"kind": "step", "step": 0, "tokens": 5})
    h.close()
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err == (
        f"ckptkit plot: {tmp_path / 'history.jsonl'}: no step row records a loss, grad_norm or lr; nothing to plot\n"
    )


def test_without_matplotlib_the_cli_names_the_extra(plain: Path, tmp_path: Path) -> None:
    """A real process in which matplotlib cannot be imported (None in sys.modules blocks the import)."""
    blocker = (
        "import sys; sys.modules['matplotlib'] = None; "
        "from ckptkit.cli import main; raise SystemExit(main(sys.argv[1:]))"
    )
    out = tmp_path / "x.png"
    proc = subprocess.run(
        [sys.executable, "-c", blocker, "plot", str(plain), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == "ckptkit plot: matplotlib is not installed: pip install 'ckptkit[plot]'\n"
    assert not out.exists()


def test_non_finite_grad_norms_are_spikes_and_leave_the_threshold_alone() -> None:
    rows = [{"kind": "step", "step": s, "grad_norm": 1.0, "loss": 1.0} for s in range(3)]
    rows.append({"kind": "step", "step": 3, "grad_norm": "NaN", "loss": "NaN"})
    rows.append({"kind": "step", "step": 4, "grad_norm": 1.0, "loss": 1.0})
    series = read_series(rows, SpikeConfig(window=3, min_history=3))
    assert math.isnan(series.spikes[0][1]) and series.spikes[0][0] == 3
    assert series.threshold[3:] == (3.0, 3.0)
    render(series)  # a NaN point is not drawn as a marker, and nothing raises


def test_kept_scalars_are_what_a_tracker_logs_one_value_per_step(rolled: Path) -> None:
    """The parsing half of docs/integrations.md's TensorBoard / W&B snippet."""
    rows = rows_of(rolled)
    logged = read_series(rows).kept_scalars()
    assert [step for step, _ in logged] == list(range(14))
    from ckptkit.run._history import kept_rows

    for (step, values), row in zip(logged, kept_rows(rows), strict=True):
        assert values == {k: row[k] for k in ("loss", "lm_loss", "aux_loss", "grad_norm", "lr")}, step
    outside = [{"kind": "step", "step": 0, "loss": 1.0}, {"kind": "step", "step": 1, "loss": "NaN", "lr": 0.1}]
    got = read_series(outside).kept_scalars()
    assert got[0] == (0, {"loss": 1.0}) and got[1][0] == 1 and math.isnan(got[1][1]["loss"]) and got[1][1]["lr"] == 0.1


def test_plot_help_shows_an_example_and_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plot", "--help"]) == 0
    out = capsys.readouterr().out
    assert "ckptkit plot runs/b -o runs/b.png" in out and "exit codes: 0 written, 2" in out


def test_a_spike_and_its_spiking_rerun_count_as_one_spike() -> None:
    """The title and summary count spikes as the trainer's summary does: the first execution
    and its re-run from the state before it are one spike; the same step spiking again later
    (after the rollback, in the next timeline) is another."""
    rows = [{"kind": "step", "step": s, "grad_norm": 1.0, "loss": 1.0} for s in range(4)]
    rows += [
        {"kind": "step", "step": 4, "grad_norm": 50.0, "loss": 1.0},
        {"kind": "spike", "step": 4, "action": "rerun"},
        {"kind": "step", "step": 4, "grad_norm": 60.0, "loss": 1.0, "rerun": True},
        {"kind": "spike", "step": 4, "action": "rollback"},
        {"kind": "rollback", "step": 4, "to": 2, "lr_before": 1e-3, "lr_after": 5e-4},
        {"kind": "step", "step": 2, "grad_norm": 1.0, "loss": 1.0},
        {"kind": "step", "step": 3, "grad_norm": 1.0, "loss": 1.0},
        {"kind": "step", "step": 4, "grad_norm": 70.0, "loss": 1.0},
    ]
    series = read_series(rows, SpikeConfig(window=4, min_history=4))
    assert [s for s, _ in series.spikes] == [4, 4, 4]  # every spiking row keeps its marker
    assert series.spike_events == 2


def test_the_loss_axis_is_fitted_past_the_first_steps_transient() -> None:
    """A start at loss 6 over a run near 2 no longer squashes the curve: the axis fits the run
    after its first 10% of steps (the start runs off the top); a run without a transient keeps
    matplotlib's own range."""
    rows = [{"kind": "step", "step": s, "loss": 6.0 if s < 3 else 2.0 + 0.01 * (s % 5)} for s in range(100)]
    fig = render(read_series(rows))
    lo, hi = fig.axes[0].get_ylim()
    assert 1.9 < lo < 2.0 and 2.04 < hi < 2.1
    flat = [{"kind": "step", "step": s, "loss": 2.0 + 0.01 * (s % 5)} for s in range(100)]
    lo, hi = render(read_series(flat)).axes[0].get_ylim()
    assert lo < 2.0 and hi > 2.04 and hi - lo < 0.1


def test_each_resume_s_check_is_a_band_over_the_steps_it_proved_or_the_step_that_differed(tmp_path: Path) -> None:
    h = History(tmp_path)
    h.start_fresh()
    for step in range(12):
        h.append({"kind": "step", "step": step, "loss": 1.0 / (step + 1), "loss_bits": "0x0"})
        if step == 4:  # resumed at 2, steps 2..4 re-run and matched (spec/determinism.md R-D23)
            h.append({"kind": "resume_check", "step": 5, "resumed_at": 2, "verdict": "verified", "from": 2, "to": 4})
        if step == 8:
            h.append({"kind": "resume_check", "step": 8, "resumed_at": 8, "verdict": "differed", "at": 8})
    h.close()
    series = read_series(read_rows(tmp_path / "history.jsonl")[0])
    assert series.checked == ((2, 4, "verified"), (8, 8, "differed"))
    fig = render(series)
    bands = {p.get_gid(): p for ax in fig.axes for p in ax.patches if str(p.get_gid()).startswith("resume_")}
    assert set(bands) == {"resume_verified", "resume_differed"}
    verified = bands["resume_verified"]
    assert isinstance(verified, Rectangle)
    assert (verified.get_x(), verified.get_x() + verified.get_width()) == (2, 5)  # steps 2..4, each to its end
    assert bands["resume_differed"].get_facecolor()[:3] == pytest.approx(
        tuple(int(COLORS["resume_differed"][i : i + 2], 16) / 255 for i in (1, 3, 5))
    )
