"""The reference trainer's parts: config, stream, schedule, latch, history, refusals, CLI."""

from __future__ import annotations

import importlib
import itertools
import json
import math
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import history, record_environment, run, tiny

from ckptkit import load
from ckptkit.cli import main
from ckptkit.errors import (
    ConfigDrift,
    EnvironmentDrift,
    FormatError,
    LegacyCheckpoint,
    ReplayDivergence,
    ResumeRefused,
)
from ckptkit.format import _container as container
from ckptkit.format._codec import encode_tree
from ckptkit.format._section import plan_section
from ckptkit.run import checkpoint_name, compared_rows
from ckptkit.run._history import History, f32_bits, f64_bits, read_rows
from ckptkit.trainer import TrainerConfig
from ckptkit.trainer._data import ByteStream, load_bytes

train_mod = importlib.import_module("ckptkit.trainer._loop")
model_mod = importlib.import_module("ckptkit.trainer._model")

# ----------------------------------------------------------------------------- randomness


def _global_rng_states() -> tuple[Any, ...]:
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _same_states(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return (
        torch.equal(a[0], b[0]) and all(np.array_equal(x, y) for x, y in zip(a[1], b[1], strict=False)) and a[2] == b[2]
    )


def test_a_training_step_leaves_every_global_rng_untouched() -> None:
    cfg = tiny(**{"model.quant": "int8", "train.rand_depth": True, "train.mask_frac": 0.5, "train.seed": 3})
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    before = _global_rng_states()
    run_ = train_mod.build(cfg)  # parameter init too: a seeded generator, never the global one
    for step in range(3):
        train_mod.train_step(run_, step)
    assert _same_states(before, _global_rng_states())


def test_a_whole_run_leaves_every_global_rng_untouched(tmp_path: Path) -> None:
    before = _global_rng_states()
    run(tiny(**{"train.quant_check": True, "model.quant": "int8"}), tmp_path, 2)
    assert _same_states(before, _global_rng_states())


def test_init_is_a_function_of_the_seed() -> None:
    a = train_mod.build(tiny(**{"train.seed": 7})).model.state_dict()
    b = train_mod.build(tiny(**{"train.seed": 7})).model.state_dict()
    c = train_mod.build(tiny(**{"train.seed": 8})).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["wte"], c["wte"])


def test_train_restores_the_deterministic_algorithms_setting(tmp_path: Path) -> None:
    was = torch.are_deterministic_algorithms_enabled()
    run(tiny(), tmp_path, 1)
    assert torch.are_deterministic_algorithms_enabled() == was
    facts = json.loads((tmp_path / "environment.json").read_text())
    assert facts["deterministic_algorithms"] is True  # recorded while the run held it
    assert facts["intra_op_threads"] == torch.get_num_threads()  # recorded, not forced


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("train.keep", 0, "--keep must be >= 1 (got 0)"),
        ("data.seq_len", 65, "--seq-len must be <= --block-size (got 65 > 64)"),
        ("model.quant", "fp8", "--quant must be one of none, int8 (got 'fp8')"),
        ("train.seed", -1, "--seed must be an integer in [0, 2**64) (got -1)"),
        ("train.lr", math.nan, "--lr must be finite, > 0.0 (got nan)"),
        ("train.ema_decay", 1.5, "--ema-decay must be finite, >= 0.0 and <= 1.0 (got 1.5)"),
        ("train.min_depth", 3, "--min-depth must be <= --n-layer (got 3 > 2)"),
        ("model.n_head", 3, "--d-model must be a multiple of --n-head (got 64 and 3)"),
    ],
)
def test_config_errors_name_the_flag(key: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainerConfig().replace(**{key: value})


def test_config_replace_refuses_an_unknown_key() -> None:
    with pytest.raises(KeyError, match=r"'train\.learning_rate' is not a config key"):
        TrainerConfig().replace(**{"train.learning_rate": 1.0})


def test_float_knobs_given_as_ints_snapshot_as_floats() -> None:
    assert TrainerConfig().replace(**{"train.lr": 1}).train.lr == 1.0
    assert isinstance(TrainerConfig().replace(**{"train.lr": 1}).train.lr, float)


# ----------------------------------------------------------------------------- data, schedule, probes


def test_stream_wraps_at_eof_and_consumes_batch_times_seq_len() -> None:
    s = ByteStream(b"abcde")
    x, y = s.next_batch(2, 3)
    assert bytes(x.flatten().tolist()) == b"abcdea" and bytes(y.flatten().tolist()) == b"bcdeab"
    assert s.offset == 6
    x2, _ = s.next_batch(1, 3)
    assert bytes(x2.flatten().tolist()) == b"bcd"
    s.seek(6)
    assert torch.equal(s.next_batch(1, 3)[0], x2)


def test_shipped_corpus_and_data_file(tmp_path: Path) -> None:
    assert len(load_bytes("")) > 10_000
    f = tmp_path / "tiny.bin"
    f.write_bytes(bytes(range(7)))
    run(tiny(**{"data.path": str(f)}), tmp_path / "run", 3)  # 64 bytes a step from a 7-byte file
    (tmp_path / "one.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="at least 2"):
        load_bytes(str(tmp_path / "one.bin"))


def test_lr_warms_up_then_decays_and_ignores_steps() -> None:
    tc = tiny(**{"train.warmup_iters": 10, "train.lr_decay_iters": 100}).train
    lrs = [train_mod.get_lr(s, tc) for s in range(120)]
    assert lrs[0] == tc.lr / 11 and lrs[9] == tc.lr * 10 / 11 and lrs[10] == tc.lr
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    assert lrs[100] == lrs[119] == tc.min_lr
    longer = TrainerConfig().replace(**{"train.steps": 10_000, "train.warmup_iters": 10, "train.lr_decay_iters": 100})
    assert [train_mod.get_lr(s, longer.train) for s in range(120)] == lrs


def test_pre_batches_follows_the_probe_gates() -> None:
    assert train_mod.pre_batches(tiny()) == 1
    assert train_mod.pre_batches(tiny(**{"train.quant_check": True})) == 1  # no int8: no quant check
    assert train_mod.pre_batches(tiny(**{"train.quant_check": True, "model.quant": "int8"})) == 2
    assert train_mod.pre_batches(tiny(**{"train.warmup_probe": False})) == 0


def test_warmup_probe_refuses_a_nondeterministic_forward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = iter(range(100))
    real = train_mod._lm_loss
    monkeypatch.setattr(train_mod, "_lm_loss", lambda *a: real(*a) + next(calls) * 1e-3)
    with pytest.raises(ReplayDivergence, match="not deterministic"):
        run(tiny(), tmp_path, 2)


# ----------------------------------------------------------------------------- the fp32 latch


def test_quant_threshold_latches_at_the_first_step(tmp_path: Path) -> None:
    run(tiny(**{"model.quant": "int8", "train.quant_threshold": 1e-9}), tmp_path, 3)
    rows = [r for r in history(tmp_path) if r["kind"] == "step"]
    assert rows[0]["latch"].startswith("quant error") and [r["compute"] for r in rows] == ["fp32"] * 3
    assert load(tmp_path / checkpoint_name(3)).fp32_fallback


def test_quant_check_latches_before_step_zero(tmp_path: Path) -> None:
    run(tiny(**{"model.quant": "int8", "train.quant_check": True, "train.quant_threshold": 1e-9}), tmp_path, 2)
    (probe,) = [r for r in history(tmp_path) if r.get("probe") == "quant_check"]
    assert probe["latched"] is True
    assert all(r["compute"] == "fp32" and r["latch"] is None for r in history(tmp_path) if r["kind"] == "step")


def test_a_non_finite_int8_loss_latches_and_the_step_trains_fp32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_mod, "fake_quant", lambda w, bits: w * math.nan)
    run(tiny(**{"model.quant": "int8", "train.warmup_probe": False}), tmp_path, 2)
    rows = [r for r in history(tmp_path) if r["kind"] == "step"]
    assert rows[0]["latch"] == "non-finite int8 loss"
    assert all(math.isfinite(r["loss"]) and r["compute"] == "fp32" for r in rows)


def test_without_quant_the_int8_path_is_never_taken(tmp_path: Path) -> None:
    run(tiny(**{"testing.trip_latch_at": 0}), tmp_path, 2)
    assert not load(tmp_path / checkpoint_name(2)).fp32_fallback


# ----------------------------------------------------------------------------- history


def test_history_rows_are_exact(tmp_path: Path) -> None:
    run(tiny(), tmp_path, 3)
    rows = history(tmp_path)
    # After each step its per-parameter digests; before the checkpoint, every leaf's digest (spec/replay.md).
    assert [r["kind"] for r in rows] == [
        "start",
        "probe",
        "step",
        "digests",
        "step",
        "digests",
        "step",
        "digests",
        "checkpoint",
    ]
    for r in (r for r in rows if r["kind"] == "step"):
        assert r["loss_bits"] == f32_bits(r["loss"]) and r["grad_norm_bits"] == f32_bits(r["grad_norm"])
        assert r["lr_bits"] == f64_bits(r["lr"])
        assert r["verdict"] == "warming_up" and r["spike"] is False
    assert all("time" not in r and "step_ms" not in r for r in compared_rows(rows))


def test_history_drops_a_torn_last_line_on_resume(tmp_path: Path) -> None:
    run(tiny(**{"train.ckpt_every": 2}), tmp_path, 2)
    with open(tmp_path / "history.jsonl", "ab") as f:
        f.write(b'{"kind":"step","step":2,"lo')  # a crash mid-append
    rows, torn = read_rows(tmp_path / "history.jsonl")
    assert torn and [r["kind"] for r in rows] == ["start", "probe", "step", "digests", "step", "digests", "checkpoint"]
    run(tiny(**{"train.ckpt_every": 2}), tmp_path, 3, resume=True)
    assert [r["step"] for r in history(tmp_path) if r["kind"] == "step"] == [0, 1, 2]


def test_history_refuses_a_corrupt_line(tmp_path: Path) -> None:
    (tmp_path / "history.jsonl").write_bytes(b'{"kind":"step","step":0}\nnot json\n')
    with pytest.raises(FormatError, match="line 2 is not JSON"):
        History(tmp_path).resume_at(1)


# ----------------------------------------------------------------------------- refusals and overrides


def test_a_fresh_start_refuses_a_directory_with_checkpoints(tmp_path: Path) -> None:
    run(tiny(), tmp_path, 1)
    with pytest.raises(ResumeRefused, match="already holds 1 checkpoint"):
        run(tiny(), tmp_path, 2)


def test_resume_refuses_other_training_bytes(tmp_path: Path) -> None:
    f = tmp_path / "data.txt"
    f.write_bytes(b"hello world " * 20)
    cfg = tiny(**{"data.path": str(f)})
    run(cfg, tmp_path / "run", 2)
    f.write_bytes(b"HELLO WORLD " * 20)
    with pytest.raises(ResumeRefused, match="training bytes differ"):
        run(cfg, tmp_path / "run", 4, resume=True)


def test_resume_refuses_drift_and_allows_cadence_changes(tmp_path: Path) -> None:
    run(tiny(), tmp_path, 2)
    with pytest.raises(ConfigDrift, match=r"train\.lr"):
        run(tiny(**{"train.lr": 1e-3}), tmp_path, 4, resume=True)
    result = run(tiny(**{"train.log_every": 7, "train.ckpt_every": 9}), tmp_path, 4, resume=True)
    assert result.step == 4


def test_environment_change_is_refused_unless_allowed_and_then_recorded(tmp_path: Path) -> None:
    run(tiny(), tmp_path, 2)
    facts = json.loads((tmp_path / "environment.json").read_text())
    facts["torch"] = "0.0.1"
    record_environment(tmp_path, facts)  # recorded under torch 0.0.1 (an edit alone is damage)
    with pytest.raises(EnvironmentDrift, match=r"torch: recorded 0\.0\.1"):
        run(tiny(), tmp_path, 3, resume=True)
    run(tiny(), tmp_path, 3, resume=True, allow_env_change=True)
    (resume,) = [r for r in history(tmp_path) if r["kind"] == "resume"]
    assert resume["allow_env_change"] is True
    assert resume["env_overrides"] == [f"torch: recorded 0.0.1, now {torch.__version__}"]


def _to_v1(path: Path) -> None:
    """Rewrite a v2 checkpoint as the legacy v1 container (model and optim only)."""
    ckpt = load(path)
    plans, start = [], 24
    for tree in (ckpt.model, ckpt.optim):
        t, tensors, _keep = encode_tree(tree, "x")
        plan = plan_section(t, tensors, start=start, legacy=True)
        plans.append(plan)
        start += plan.length
    path.write_bytes(container._encode_v1(ckpt.step, *plans))


def test_a_legacy_checkpoint_is_refused_unless_allowed_and_then_recorded(tmp_path: Path) -> None:
    run(tiny(), tmp_path, 2)
    _to_v1(tmp_path / checkpoint_name(2))
    with pytest.raises(LegacyCheckpoint, match="allow-legacy"):
        run(tiny(), tmp_path, 3, resume=True)
    result = run(tiny(), tmp_path, 3, resume=True, allow_legacy=True)
    (resume,) = [r for r in history(tmp_path) if r["kind"] == "resume"]
    assert resume["allow_legacy"] is True
    assert set(resume["legacy_missing"]) >= {"teacher", "flags", "monitor"}
    assert any("teacher: the legacy checkpoint carries none" in n for n in resume["notes"])
    assert result.report["observed"] == 1  # the monitor restarted: v1 cannot carry it, and it says so
    assert load(tmp_path / checkpoint_name(3)).monitor["data"]["train"] == (3 + 1) * 4 * 16


# ----------------------------------------------------------------------------- command line


def test_cli_help_shows_an_example_the_exit_codes_and_the_testing_aid(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "example:" in out and "exit codes:" in out
    assert re.search(r"--trip-latch-at .*TESTING AID", out, re.S)
    for flag in (
        "--lr",
        "--seed",
        "--batch",
        "--seq-len",
        "--ckpt-every",
        "--log-every",
        "--keep",
        "--data",
        "--quant",
        "--quant-threshold",
        "--quant-check",
        "--no-aux",
        "--rand-depth",
        "--ema-decay",
    ):
        assert flag in out


def test_cli_trains_and_resumes_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    knobs = [
        "--n-layer",
        "1",
        "--d-model",
        "32",
        "--block-size",
        "16",
        "--seq-len",
        "16",
        "--batch",
        "2",
        "--run-dir",
        str(tmp_path),
    ]
    assert main(["train", "--steps", "2", "--quiet", *knobs]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"step 2: {tmp_path / checkpoint_name(2)}"
    assert main(["train", "--steps", "3", "--resume", "--json", "--quiet", *knobs]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema_version"] == 1 and out["step"] == 3 and out["resume_notes"][0].startswith("train.steps 2 -> 3")


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["--keep", "0"], 2, "--keep must be >= 1 (got 0)"),
        (["--data", "/nonexistent/file"], 2, "--data /nonexistent/file: no such file"),
        (["--resume"], 2, "no checkpoints to resume from"),
    ],
)
def test_cli_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], code: int, message: str
) -> None:
    assert main(["train", "--run-dir", str(tmp_path / "run"), *argv]) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_refusals_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = [
        "train",
        "--run-dir",
        str(tmp_path),
        "--quiet",
        "--n-layer",
        "1",
        "--d-model",
        "32",
        "--batch",
        "2",
        "--seq-len",
        "8",
        "--block-size",
        "8",
    ]
    assert main([*base, "--steps", "1"]) == 0
    assert main([*base, "--steps", "1"]) == 1  # fresh start over checkpoints
    assert main([*base, "--steps", "2", "--resume", "--rand-depth"]) == 1  # drift
    assert "train.rand_depth false -> true" in capsys.readouterr().err


# ----------------------------------------------------------------------------- layering


def test_the_format_library_never_imports_the_trainer() -> None:
    init = importlib.import_module("ckptkit").__file__
    assert init is not None
    root = Path(init).parent
    offenders = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root).as_posix()
        if rel.startswith("trainer/") or rel in ("cli/_train.py", "cli/_replay.py", "cli/_audit.py"):
            continue
        if re.search(r"^\s*(from|import)\s+(\.+|ckptkit\.)trainer\b", f.read_text(), re.M):
            offenders.append(rel)
    assert offenders == []
