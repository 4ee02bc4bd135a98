"""ckptkit.guard._monitor: the spike / stability monitor (spec/rollback.md R-M01..R-M12)."""

from __future__ import annotations

import copy
import math
import re
import struct
import subprocess
import sys
from typing import Any

import msgpack
import pytest
from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptkit.errors import CheckpointError, ConfigDrift, MalformedIndex, UnsupportedVersion
from ckptkit.guard import _monitor as monitor_module
from ckptkit.guard._monitor import REASONS, STATE_VERSION, SpikeConfig, SpikeMonitor, Verdict

NAN = float("nan")
INF = float("inf")


def _bits(obj: Any) -> Any:
    """A structure in which floats are replaced by their IEEE bits, so NaN == NaN."""
    if isinstance(obj, float):
        return ("f", struct.pack("<d", obj))
    if isinstance(obj, Verdict):
        return ("Verdict", _bits(obj.__dict__))
    if isinstance(obj, dict):
        return {k: _bits(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_bits(v) for v in obj]
    return (type(obj).__name__, obj)


def _warm(m: SpikeMonitor, values: list[float], start: int = 0) -> int:
    for i, g in enumerate(values):
        v = m.observe(start + i, g, 1.0)
        assert not v.is_spike
    return start + len(values)


def _plain(obj: Any, where: str = "state") -> None:
    """Fail unless obj holds only msgpack-able builtins (exact types, str keys)."""
    if obj is None or type(obj) in (bool, int, float, str):
        return
    if type(obj) is list:
        for i, v in enumerate(obj):
            _plain(v, f"{where}[{i}]")
        return
    if type(obj) is dict:
        for k, v in obj.items():
            assert type(k) is str, f"{where}: key {k!r}"
            _plain(v, f"{where}.{k}")
        return
    raise AssertionError(f"{where}: {type(obj).__name__} is not a plain value")


# ---------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 0, "min_history": 1}, "window must be >= 1 (got 0)"),
        ({"multiplier": 0.0}, "multiplier must be finite and > 0 (got 0.0)"),
        ({"multiplier": INF}, "multiplier must be finite and > 0 (got inf)"),
        ({"multiplier": NAN}, "multiplier must be finite and > 0 (got nan)"),
        ({"min_history": 0}, "min_history must be >= 1 (got 0)"),
        ({"window": 5, "min_history": 6}, "min_history must be <= window (got min_history=6, window=5)"),
        ({"floor": -1e-9}, "floor must be finite and >= 0 (got -1e-09)"),
        ({"floor": INF}, "floor must be finite and >= 0 (got inf)"),
        ({"history": -1}, "history must be >= 0 (got -1)"),
    ],
)
def test_config_refuses_bad_values_naming_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        SpikeConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 50.0}, "window must be an int (got float)"),
        ({"min_history": True}, "min_history must be an int (got bool)"),
        ({"multiplier": "3"}, "multiplier must be a number (got str)"),
    ],
)
def test_config_refuses_wrong_types_naming_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError) as info:
        SpikeConfig(**kwargs)
    assert str(info.value) == message


def test_config_boundaries_are_accepted() -> None:
    SpikeConfig(window=1, min_history=1, history=0, floor=0.0, multiplier=1e-300)
    SpikeConfig(window=5, min_history=5)
    assert SpikeConfig(multiplier=3).multiplier == 3.0 and type(SpikeConfig(floor=1).floor) is float


def test_config_defaults_are_the_product_spec() -> None:
    # B12: window 50 steps, multiplier 3x.
    cfg = SpikeConfig()
    assert (cfg.window, cfg.multiplier, cfg.min_history, cfg.floor, cfg.history) == (50, 3.0, 10, 0.0, 1000)


# ---------------------------------------------------------------------- detection


def test_grad_norm_above_multiplier_times_median_is_a_spike() -> None:
    m = SpikeMonitor(SpikeConfig(window=10, min_history=5))
    step = _warm(m, [1.0, 2.0, 3.0, 4.0, 5.0])
    v = m.observe(step, 10.0, 1.0)
    assert v == Verdict(step, 10.0, 1.0, 3.0, 10.0 / 3.0, True, "grad_norm")


def test_trigger_is_strictly_greater_than_the_threshold() -> None:
    m = SpikeMonitor(SpikeConfig(window=10, min_history=3))
    step = _warm(m, [2.0, 2.0, 2.0])
    assert m.observe(step, 6.0, 1.0).reason == "ok"  # == 3 * 2 is not a spike
    assert m.observe(step + 1, math.nextafter(6.0, INF), 1.0).reason == "grad_norm"


def test_min_history_boundary() -> None:
    m = SpikeMonitor(SpikeConfig(window=10, min_history=3))
    step = _warm(m, [1.0, 1.0])
    assert m.observe(step, 100.0, 1.0).reason == "warming_up"  # 2 accepted values: not yet
    m = SpikeMonitor(SpikeConfig(window=10, min_history=3))
    step = _warm(m, [1.0, 1.0, 1.0])
    assert m.observe(step, 100.0, 1.0).reason == "grad_norm"


def test_warming_up_values_enter_the_window() -> None:
    m = SpikeMonitor(SpikeConfig(window=10, min_history=3))
    v = m.observe(0, 100.0, 1.0)
    assert (v.is_spike, v.reason, v.median, v.ratio) == (False, "warming_up", None, None)
    assert m.report()["window"] == {"size": 1, "median": 100.0}


def test_floor_suppresses_spikes_at_or_below_it() -> None:
    m = SpikeMonitor(SpikeConfig(window=10, min_history=3, floor=1e-3))
    step = _warm(m, [1e-6, 1e-6, 1e-6])
    assert m.observe(step, 1e-3, 1.0).reason == "ok"  # 1000x the median, but == floor
    assert m.observe(step + 1, math.nextafter(1e-3, INF), 1.0).reason == "grad_norm"


@pytest.mark.parametrize("bad", [NAN, INF])
def test_non_finite_grad_norm_is_a_spike_even_while_warming_up(bad: float) -> None:
    m = SpikeMonitor(SpikeConfig(window=10, min_history=5))
    v = m.observe(0, bad, 1.0)
    assert (v.is_spike, v.reason) == (True, "non_finite_grad_norm")
    assert m.report()["window"]["size"] == 0


def test_nan_grad_norm_is_a_spike_with_a_full_window() -> None:
    # NaN > 3 * median is False; the monitor must not rely on that comparison.
    m = SpikeMonitor(SpikeConfig(window=5, min_history=5))
    step = _warm(m, [1.0] * 5)
    v = m.observe(step, NAN, 1.0)
    assert (v.is_spike, v.reason, v.median) == (True, "non_finite_grad_norm", 1.0)
    assert math.isnan(v.ratio)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_non_finite_loss_is_a_spike_and_its_grad_norm_stays_out(bad: float) -> None:
    m = SpikeMonitor(SpikeConfig(window=10, min_history=5))
    v = m.observe(0, 1.0, bad)
    assert (v.is_spike, v.reason) == (True, "non_finite_loss")
    assert m.report()["window"]["size"] == 0


def test_a_spike_never_enters_the_window() -> None:
    m = SpikeMonitor(SpikeConfig(window=4, min_history=4))
    step = _warm(m, [1.0, 1.0, 1.0, 1.0])
    for i in range(20):  # a long run of spikes cannot drag the median up
        assert m.observe(step + i, 50.0, 1.0).is_spike
    assert m.report()["window"] == {"size": 4, "median": 1.0}


def test_median_is_the_lower_median_for_even_counts() -> None:
    m = SpikeMonitor(SpikeConfig(window=4, min_history=1))
    _warm(m, [4.0, 1.0, 3.0, 2.0])
    assert m.observe(4, 2.5, 1.0).median == 2.0


def test_window_keeps_the_last_values_in_arrival_order() -> None:
    m = SpikeMonitor(SpikeConfig(window=3, min_history=1, multiplier=1000.0))
    _warm(m, [5.0, 1.0, 2.0, 3.0])
    assert m.state_dict()["detector"]["window"] == [1.0, 2.0, 3.0]
    assert m.report()["window"]["median"] == 2.0


def test_ratio_is_none_when_the_median_is_zero() -> None:
    m = SpikeMonitor(SpikeConfig(window=3, min_history=1))
    _warm(m, [0.0])
    v = m.observe(1, 5.0, 1.0)
    assert (v.median, v.ratio, v.reason) == (0.0, None, "grad_norm")


def test_observe_accepts_a_zero_dim_tensor_without_the_monitor_importing_torch() -> None:
    import torch

    m = SpikeMonitor()
    v = m.observe(0, torch.tensor(2.5), torch.tensor(1.25))
    assert (v.grad_norm, v.loss) == (2.5, 1.25) and type(v.grad_norm) is float


def test_import_does_not_import_torch() -> None:
    code = "import sys, ckptkit.guard._monitor; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize(
    ("calls", "exc", "message"),
    [
        ([(5, 1.0, 1.0), (5, 1.0, 1.0)], ValueError, "step must be > the last observed step 5 (got 5)"),
        ([(5, 1.0, 1.0), (4, 1.0, 1.0)], ValueError, "step must be > the last observed step 5 (got 4)"),
        ([(-1, 1.0, 1.0)], ValueError, "step must be >= 0 (got -1)"),
        ([(1.5, 1.0, 1.0)], TypeError, "step must be an int (got float)"),
        ([(0, -0.5, 1.0)], ValueError, "grad_norm must be >= 0 (got -0.5)"),
    ],
)
def test_observe_refuses_bad_input(calls: list[tuple[Any, float, float]], exc: type, message: str) -> None:
    m = SpikeMonitor()
    for call in calls[:-1]:
        m.observe(*call)
    with pytest.raises(exc, match=f"^{re.escape(message)}$"):
        m.observe(*calls[-1])


# ---------------------------------------------------------------------- report


def test_report_counts_spikes_refusals_and_statistics() -> None:
    m = SpikeMonitor(SpikeConfig(window=10, min_history=3))
    _warm(m, [1.0, 2.0, 3.0])
    m.observe(3, 30.0, 1.0)
    m.refuse(3)
    m.observe(4, NAN, 1.0)
    m.observe(5, 2.0, INF)
    r = m.report()
    assert r["observed"] == 6 and r["last_step"] == 5
    assert r["spikes"] == 3
    assert r["spikes_by_reason"] == {"grad_norm": 1, "non_finite_grad_norm": 1, "non_finite_loss": 1}
    assert [s["step"] for s in r["recent_spikes"]] == [3, 4, 5]
    assert r["recent_spikes"][0] == {"step": 3, "reason": "grad_norm", "grad_norm": 30.0, "loss": 1.0, "median": 2.0}
    assert r["refused"] == [3] and r["refused_count"] == 1
    g = r["grad_norm"]
    assert (g["count"], g["non_finite"], g["min"], g["max"], g["mean"]) == (5, 1, 1.0, 30.0, 38.0 / 5)
    assert (g["recent"], g["p50"], g["p99"], g["p999"]) == (5, 2.0, 30.0, 30.0)
    _plain(r)


def test_report_of_a_fresh_monitor() -> None:
    r = SpikeMonitor().report()
    assert r["observed"] == 0 and r["spikes"] == 0 and r["last_step"] is None
    assert r["grad_norm"]["mean"] is None and r["grad_norm"]["p50"] is None
    assert r["window"] == {"size": 0, "median": None}


def test_report_memory_is_bounded_by_history() -> None:
    m = SpikeMonitor(SpikeConfig(window=2, min_history=1, history=3))
    for step in range(50):
        m.observe(step, NAN if step % 2 else 1.0, 1.0)
        m.refuse(step)
    r = m.report()
    assert [s["step"] for s in r["recent_spikes"]] == [45, 47, 49]
    assert r["refused"] == [47, 48, 49] and r["refused_count"] == 50
    assert r["spikes"] == 25 and r["grad_norm"]["recent"] == 3 and r["grad_norm"]["count"] == 25


def test_refuse_validates_the_step() -> None:
    with pytest.raises(ValueError, match=r"^step must be >= 0 \(got -2\)$"):
        SpikeMonitor().refuse(-2)


def test_reasons_are_pinned() -> None:
    assert REASONS == ("ok", "warming_up", "grad_norm", "non_finite_grad_norm", "non_finite_loss")


# ---------------------------------------------------------------------- state


def test_state_dict_is_plain_and_survives_msgpack() -> None:
    m = SpikeMonitor(SpikeConfig(window=4, min_history=2))
    _warm(m, [1.0, 2.0])
    m.observe(2, NAN, 1.0)
    m.refuse(2)
    state = m.state_dict()
    _plain(state)
    assert state["version"] == STATE_VERSION == 1
    back = msgpack.unpackb(msgpack.packb(state), strict_map_key=True)
    assert _bits(back) == _bits(state)


def test_state_dict_is_a_snapshot_not_a_view() -> None:
    m = SpikeMonitor(SpikeConfig(window=4, min_history=1))
    _warm(m, [1.0, 2.0])
    m.refuse(1)
    state = m.state_dict()
    before = copy.deepcopy(state)
    m.observe(2, 3.0, 1.0)
    m.refuse(2)
    assert _bits(state) == _bits(before)  # the monitor moved on; the snapshot did not
    state["detector"]["window"].append(99.0)
    state["report"]["refused"].clear()
    assert m.state_dict()["detector"]["window"] == [1.0, 2.0, 3.0]
    assert m.report()["refused"] == [1, 2]


_FLOATS = st.one_of(
    st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
    st.sampled_from([0.0, 1.0, 5.0, 1e300, NAN, INF]),
)
_EVENTS = st.lists(
    st.tuples(
        st.integers(1, 3), _FLOATS, st.one_of(st.floats(-10, 10), st.sampled_from([NAN, INF, -INF])), st.booleans()
    ),
    max_size=80,
)
_CONFIGS = st.builds(
    lambda w, mh, mult, floor, hist: SpikeConfig(
        window=w, min_history=min(mh, w), multiplier=mult, floor=floor, history=hist
    ),
    st.integers(1, 8),
    st.integers(1, 8),
    st.sampled_from([1.5, 3.0]),
    st.sampled_from([0.0, 2.0]),
    st.integers(0, 6),
)


def _run(m: SpikeMonitor, events: list[tuple[int, float, float, bool]], step: int) -> tuple[list[Any], int]:
    out = []
    for gap, g, loss, refuse in events:
        step += gap
        v = m.observe(step, g, loss)
        if refuse:
            m.refuse(step)
        out.append(_bits(v))
        out.append(_bits(m.report()))
    return out, step


@settings(max_examples=examples(12))
@given(_CONFIGS, _EVENTS, st.integers(0, 80))
def test_save_load_continues_exactly_as_never_saved(cfg: SpikeConfig, events: list[Any], split: int) -> None:
    split = min(split, len(events))
    straight = SpikeMonitor(cfg)
    expected, _ = _run(straight, events, 0)

    first = SpikeMonitor(cfg)
    got, step = _run(first, events[:split], 0)
    blob = msgpack.packb(first.state_dict())
    resumed = SpikeMonitor(cfg)
    resumed.load_state_dict(msgpack.unpackb(blob, strict_map_key=True))
    assert _bits(resumed.state_dict()) == _bits(first.state_dict())
    rest, _ = _run(resumed, events[split:], step)
    assert got + rest == expected
    assert _bits(resumed.state_dict()) == _bits(straight.state_dict())


def test_from_state_dict_uses_the_recorded_config() -> None:
    cfg = SpikeConfig(window=7, min_history=2, multiplier=2.0, floor=0.5, history=9)
    m = SpikeMonitor(cfg)
    _warm(m, [1.0, 1.5, 1.2])
    restored = SpikeMonitor.from_state_dict(m.state_dict())
    assert restored.config == cfg
    assert _bits(restored.state_dict()) == _bits(m.state_dict())


def test_load_refuses_a_different_config_naming_every_field() -> None:
    state = SpikeMonitor(SpikeConfig(window=20, multiplier=2.5)).state_dict()
    with pytest.raises(ConfigDrift) as info:
        SpikeMonitor(SpikeConfig()).load_state_dict(state)
    assert str(info.value) == (
        "monitor state was recorded with a different spike config: window: recorded 20, configured 50; "
        "multiplier: recorded 2.5, configured 3.0 (the spike config is part of the run config; "
        "resume with the recorded values)"
    )
    assert len(info.value.differences) == 2


def _state() -> dict[str, Any]:
    m = SpikeMonitor(SpikeConfig(window=3, min_history=1, history=2))
    _warm(m, [1.0, 2.0])
    m.observe(2, NAN, 1.0)
    m.refuse(2)
    return m.state_dict()


def _with(path: str, value: Any) -> dict[str, Any]:
    state = _state()
    *parents, last = path.split(".")
    node = state
    for p in parents:
        node = node[p]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return state


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "exc", "message"),
    [
        (
            "version",
            2,
            UnsupportedVersion,
            (
                "monitor.version: monitor state version not supported (expected 1, got 2); "
                "upgrade ckptkit to read this checkpoint"
            ),
        ),
        ("version", _DELETE, MalformedIndex, "monitor.version: version must be an int (got NoneType)"),
        ("version", True, MalformedIndex, "monitor.version: version must be an int (got bool)"),
        ("report", _DELETE, MalformedIndex, "monitor: missing key(s) report"),
        ("extra", 1, MalformedIndex, "monitor: unknown key(s) extra"),
        (
            "detector.window",
            [1.0, 2.0, 3.0, 4.0],
            MalformedIndex,
            "monitor.detector.window: window holds more values than the config allows (expected <= 3, got 4)",
        ),
        ("detector.window", [1], MalformedIndex, "monitor.detector.window[0]: must be a float (got int)"),
        (
            "detector.window",
            [NAN],
            MalformedIndex,
            "monitor.detector.window: window holds nan; window values must be finite and >= 0",
        ),
        (
            "detector.window",
            [-1.0],
            MalformedIndex,
            "monitor.detector.window: window holds -1.0; window values must be finite and >= 0",
        ),
        ("detector.window", "1.0", MalformedIndex, "monitor.detector.window: must be a list (got str)"),
        ("detector.last_step", -1, MalformedIndex, "monitor.detector.last_step: must be an int >= 0 (got -1)"),
        ("detector.last_step", None, MalformedIndex, "monitor.detector: window is not empty but last_step is None"),
        ("config.window", 0, MalformedIndex, "monitor.config: invalid spike config: window must be >= 1 (got 0)"),
        ("config.colour", "red", MalformedIndex, "monitor.config: unknown key(s) colour"),
        ("report.observed", True, MalformedIndex, "monitor.report.observed: must be an int >= 0 (got True)"),
        (
            "report.spikes",
            {"grad_norm": 1},
            MalformedIndex,
            "monitor.report.spikes: missing key(s) non_finite_grad_norm, non_finite_loss",
        ),
        (
            "report.recent",
            [1.0, 2.0, 3.0],
            MalformedIndex,
            "monitor.report.recent: recent holds more values than the config allows (expected <= 2, got 3)",
        ),
        (
            "report.refused",
            [1, 2, 3],
            MalformedIndex,
            "monitor.report.refused: refused is longer than history (expected <= 2, got 3)",
        ),
        ("report.refused", [-1], MalformedIndex, "monitor.report.refused[0]: must be an int >= 0 (got -1)"),
        ("report.sum", 3, MalformedIndex, "monitor.report.sum: must be a float (got int)"),
        (
            "report.recent_spikes",
            [{"step": 1}],
            MalformedIndex,
            "monitor.report.recent_spikes[0]: missing key(s) grad_norm, loss, median, reason",
        ),
        (
            "report.recent_spikes",
            [{"step": 1, "reason": "ok", "grad_norm": 1.0, "loss": 1.0, "median": None}],
            MalformedIndex,
            "monitor.report.recent_spikes[0]: reason 'ok' is not a spike reason",
        ),
    ],
)
def test_load_refuses_malformed_state(path: str, value: Any, exc: type, message: str) -> None:
    m = SpikeMonitor(SpikeConfig(window=3, min_history=1, history=2))
    before = _bits(m.state_dict())
    with pytest.raises(exc) as info:
        m.load_state_dict(_with(path, value))
    assert str(info.value) == message
    assert _bits(m.state_dict()) == before  # a refused load changes nothing


def test_load_refuses_a_non_dict() -> None:
    with pytest.raises(MalformedIndex) as info:
        SpikeMonitor().load_state_dict([1, 2])  # type: ignore[arg-type]
    assert str(info.value) == "monitor: state must be a dict (got list)"


_JUNK = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 2**65), st.floats(), st.text(max_size=3)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=6,
)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


@settings(max_examples=examples(12))
@given(st.data())
def test_any_corrupted_state_raises_only_ckptkit_errors(data: st.DataObject) -> None:
    state = _state()
    path = data.draw(st.sampled_from(_paths(state)))
    node = state
    for p in path[:-1]:
        node = node[p]
    if data.draw(st.booleans()) and isinstance(node, dict):
        del node[path[-1]]
    else:
        node[path[-1]] = data.draw(_JUNK)
    m = SpikeMonitor(SpikeConfig(window=3, min_history=1, history=2))
    try:
        m.load_state_dict(state)
    except CheckpointError:
        return
    # Accepted: then it must be a state the monitor can use and re-emit.
    _plain(m.state_dict())
    m.report()
    m.observe((m.last_step or 0) + 1, 1.0, 1.0)


# ---------------------------------------------------------------------- rewind (rollback)


def test_rewind_restores_the_window_and_keeps_the_report() -> None:
    m = SpikeMonitor(SpikeConfig(window=4, min_history=2))
    _warm(m, [1.0, 1.0, 1.0])
    snapshot = m.state_dict()  # e.g. saved with the checkpoint of step 2
    m.observe(3, 1.5, 1.0)
    v = m.observe(4, 40.0, 1.0)
    assert v.is_spike
    m.refuse(4)
    m.rewind(snapshot)
    assert m.last_step == 2
    assert m.state_dict()["detector"] == snapshot["detector"]
    r = m.report()
    assert r["spikes"] == 1 and r["refused"] == [4] and r["observed"] == 5
    m.observe(3, 1.5, 1.0)  # the re-run steps are judged against the restored window


def test_rewind_refuses_a_snapshot_from_the_future() -> None:
    m = SpikeMonitor(SpikeConfig(window=4, min_history=2))
    _warm(m, [1.0, 1.0, 1.0])
    ahead = m.state_dict()
    m.rewind(ahead)  # the same step is fine
    with pytest.raises(
        ValueError,
        match=re.escape("rewind snapshot is ahead of the monitor (snapshot last step 2, monitor last step None)"),
    ):
        SpikeMonitor(SpikeConfig(window=4, min_history=2)).rewind(ahead)


def test_public_names() -> None:
    assert sorted(monitor_module.__all__) == monitor_module.__all__
