"""Helpers shared by several test files: import them from here, never from another test file.

- bits / same: exact (bitwise) comparison of tensors and trees.
- tiny / run / history / artifacts / assert_same_run / Crash: the reference trainer at test size.
- Cfg / Loop / trained: a user's loop registered with every kind of RunState state.
- record_environment: make a run look recorded under other environment facts.
- Flat: a config without tables.
- load_script / fixture_generator / hostile_generator: scripts outside the package (the
  fixture writers, benches) imported by path, once per process.
- examples: a property test's example count, as a share of the hypothesis profile's.
- import_error_without: what importing an integration says in a process without its package.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from hypothesis import settings

import ckptkit
from ckptkit import RunState, SpikeConfig
from ckptkit.guard import SpikeMonitor
from ckptkit.run import checkpoint_name, compared_rows, read_rows
from ckptkit.trainer import StepResult, TrainerConfig, train

ROOT = Path(__file__).resolve().parents[1]


def examples(share: float) -> int:
    """A property test's example count: ``share`` of the active hypothesis profile's.

    A cheap invariant over a wide input space takes several times the profile's count,
    one whose example trains a run takes a fraction; every count follows the profile
    (root ``conftest.py``), so ``HYPOTHESIS_PROFILE=thorough`` widens all of them.
    """
    return max(1, round(settings().max_examples * share))


def bits(t: torch.Tensor) -> bytes:
    """The exact bytes of a tensor (NaN payloads and -0.0 included)."""
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def same(a, b) -> bool:
    """Bitwise equality of two trees (tensors by bytes, dtype and shape; tuples stay tuples)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return isinstance(b, float) and struct.pack("<d", a) == struct.pack("<d", b)
    return type(a) is type(b) and a == b


# Small enough that a step takes a few milliseconds on one core.
TINY = {
    "model.n_layer": 2,
    "model.n_head": 2,
    "model.d_model": 32,
    "model.block_size": 16,
    "data.seq_len": 16,
    "data.batch": 4,
    "train.log_every": 1000,
    "train.keep": 100,
    "train.warmup_iters": 2,
}
# The tiny model as ``ckptkit train`` flags (the CLI's view of :data:`TINY`'s model and data).
TINY_FLAGS = [
    "--n-layer", "2", "--n-head", "2", "--d-model", "32", "--block-size", "16",
    "--seq-len", "16", "--batch", "4", "--warmup-iters", "2",
]  # fmt: skip


def tiny(**changes: Any) -> TrainerConfig:
    """The test config: TINY plus ``changes`` (dotted keys, e.g. ``**{"train.aux": False}``)."""
    return TrainerConfig().replace(**{**TINY, **changes})


class Crash(Exception):
    """Raised from ``on_step`` to kill a run between checkpoints."""


def run(
    cfg: TrainerConfig, run_dir: Path, steps: int, *, resume: bool = False, crash_after: int | None = None, **kw: Any
) -> Any:
    """Train ``cfg`` to ``steps`` in ``run_dir``; with ``crash_after`` die once that many steps are done."""

    def on_step(r: StepResult) -> None:
        if crash_after is not None and r.step + 1 == crash_after:
            raise Crash(crash_after)

    cfg = cfg.replace(**{"train.steps": steps})
    try:
        return train(cfg, run_dir, resume=resume, log=None, on_step=on_step, **kw)
    except Crash:
        return None


def artifacts(run_dir: Path, step: int) -> dict[str, bytes]:
    """Every file of the checkpoint at ``step``: container, snapshot, sidecars."""
    base = checkpoint_name(step)
    return {name: (run_dir / name).read_bytes() for name in sorted(os.listdir(run_dir)) if name.startswith(base)}


def history(run_dir: Path) -> list[dict[str, Any]]:
    rows, torn = read_rows(run_dir / "history.jsonl")
    assert not torn
    return rows


def assert_same_run(a: Path, b: Path, step: int) -> None:
    """Checkpoint ``step`` identical byte for byte, and identical compared history rows."""
    fa, fb = artifacts(a, step), artifacts(b, step)
    assert sorted(fa) == sorted(fb)
    assert checkpoint_name(step) in fa
    # Compare outside `assert`: pytest's rich diff of megabytes of bytes or rows takes minutes.
    for name in fa:
        same = fa[name] == fb[name]
        assert same, f"{name} differs between the uninterrupted and the resumed run"
    ra, rb = compared_rows(history(a)), compared_rows(history(b))
    if ra != rb:
        i = next((i for i, (x, y) in enumerate(zip(ra, rb, strict=False)) if x != y), min(len(ra), len(rb)))
        raise AssertionError(
            f"history differs first at compared row {i} ({len(ra)} vs {len(rb)} rows): "
            f"{str(ra[i : i + 1])[:300]} != {str(rb[i : i + 1])[:300]}"
        )


def record_environment(run_dir: Path, facts: dict[str, object]) -> None:
    """Make ``run_dir`` look recorded under ``facts``: its environment.json, and the
    digest of it its checkpoints bind (R-C03) -- an edit alone is damage."""
    from ckptkit.format._companions import rebind
    from ckptkit.run import list_checkpoints

    (run_dir / "environment.json").write_text(json.dumps(facts, sort_keys=True, indent=2) + "\n")
    for _step, path in list_checkpoints(run_dir):
        rebind(path)


@dataclasses.dataclass(frozen=True)
class HalfLr:
    lr: float = 0.5  # learning rate


def linear_run(run_dir: Path) -> tuple[RunState, torch.nn.Linear]:
    """The smallest run with every companion: one ``Linear(3, 2)`` (seed 0) and an ``ngram`` sidecar."""
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    table = {"t": torch.zeros(4, dtype=torch.int64)}
    rs = RunState(run_dir, config=HalfLr(), keep=5)
    rs.add_model("net", net)
    rs.add_sidecar("ngram", get=lambda: (0, table), set=lambda ts, tree: table.update(tree))
    return rs, net


@dataclasses.dataclass
class Cfg:
    lr: float = 0.01
    width: int = 8
    steps: int = 10
    ckpt_every: int = 2


class Loop:
    """A user's loop: two optimizers, a scheduler, a scaler, an EMA teacher, a
    spike monitor, a data position, a value, the fp32 flag and a sidecar."""

    def __init__(
        self,
        run_dir: Path,
        cfg: Cfg | None = None,
        *,
        seed: int = 0,
        width: int | None = None,
        keep: int = 3,
        rule: Any = None,
        async_save: bool = False,
        log: Any = None,
    ) -> None:
        self.cfg = cfg or Cfg()
        w = width or self.cfg.width
        g = ckptkit.torch_generator(seed, 0, stream=1)
        self.body = torch.nn.Linear(4, w)
        self.head = torch.nn.Linear(w, 1)
        with torch.no_grad():
            for p in [*self.body.parameters(), *self.head.parameters()]:
                p.copy_(torch.randn(p.shape, generator=g))
        self.teacher = torch.nn.Linear(4, w)
        self.teacher.load_state_dict(self.body.state_dict())
        self.opt_body = torch.optim.AdamW(self.body.parameters(), lr=self.cfg.lr)
        self.opt_head = torch.optim.SGD(self.head.parameters(), lr=self.cfg.lr, momentum=0.9)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt_body, step_size=2, gamma=0.5)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
        self.monitor = SpikeMonitor(SpikeConfig(window=8, min_history=2))
        self.position = 0
        self.tokens_seen: dict[str, Any] = {"total": 0, "by_source": [0, 0]}
        self.fp32 = False
        self.table: dict[str, Any] = {"counts": torch.zeros(3, dtype=torch.int64)}
        self.table_step = 0
        self.restored: list[str] = []
        self.state = rs = RunState(run_dir, config=self.cfg, keep=keep, async_save=async_save, log=log)
        rs.add_model("body", self.body)
        rs.add_model("head", self.head)
        rs.add_optimizer("adamw", self.opt_body)
        rs.add_optimizer("sgd", self.opt_head)
        rs.add_scheduler("lr", self.sched)
        rs.add_scaler("amp", self.scaler)
        rs.add_teacher(self.teacher)
        rs.add_monitor("spike", self.monitor)
        rs.add_data_position(
            "train", get=lambda: self.position, set=self._seek, expected=rule or (lambda step, _values: 4 * step)
        )
        rs.add_value("tokens", get=lambda: self.tokens_seen, set=lambda v: setattr(self, "tokens_seen", v))
        rs.add_flag("fp32_fallback", get=lambda: self.fp32, set=lambda v: setattr(self, "fp32", v))
        rs.add_sidecar("counts", get=lambda: (self.table_step, self.table), set=self._load_table)
        rs.after_restore(lambda: self.restored.append(f"after restore at position {self.position}"))

    def _seek(self, position: int) -> None:
        self.position = position

    def _load_table(self, table_step: int, tree: Any) -> None:
        self.table_step, self.table = table_step, tree

    def step(self, i: int) -> None:
        g = ckptkit.torch_generator(7, i, stream=2)
        x = torch.randn(4, 4, generator=g)
        self.position += 4
        loss = (self.head(torch.relu(self.body(x))) ** 2).mean()
        self.opt_body.zero_grad()
        self.opt_head.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt_body)
        self.scaler.step(self.opt_head)
        self.scaler.update()
        self.sched.step()
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.body.parameters(), strict=True):
                t.mul_(0.9).add_(s, alpha=0.1)
        grad = float(
            torch.linalg.vector_norm(
                torch.cat([p.grad.flatten() for p in self.body.parameters() if p.grad is not None])
            )
        )
        self.monitor.observe(i, grad, float(loss.detach()))
        self.tokens_seen["total"] += 16
        self.tokens_seen["by_source"][i % 2] += 16
        self.table["counts"][i % 3] += 1
        self.table_step = i + 1
        self.fp32 = self.fp32 or i == 2


def trained(run_dir: Path, steps: int = 4, **kw: Any) -> Loop:
    loop = Loop(run_dir, **kw)
    loop.state.start()
    for i in range(steps):
        loop.step(i)
        if (i + 1) % 2 == 0:
            loop.state.save(i + 1)
    return loop


@dataclasses.dataclass
class Flat:
    """A config without tables (snapshot, drift and `ckptkit diff` tests)."""

    lr: float = 1e-3
    steps: int = 10
    seed: int = 1


def load_script(name: str, path: Path) -> Any:
    """The script at ``path`` (not a package module: a fixture writer, a bench) imported as
    module ``name``, once per process, so every test file shares one copy of it."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def fixture_generator() -> Any:
    """``fixtures/generate.py``: it defines the manifest's facts and rebuilds every golden file."""
    return load_script("fixtures_generate", ROOT / "fixtures" / "generate.py")


def hostile_generator() -> Any:
    """``fixtures/hostile/generate.py``: the independent writer of the hostile corpus (and its building blocks)."""
    return load_script("ckptkit_hostile_generate", ROOT / "fixtures" / "hostile" / "generate.py")


def import_error_without(package: str, module: str) -> str:
    """The ``ModuleNotFoundError`` that importing ``module`` prints in a real process in which
    ``package`` cannot be imported (asserting that process printed nothing else)."""
    import subprocess

    code = (
        f"import sys; sys.modules[{package!r}] = None\n"
        f"try:\n    import {module}\n"
        "except ModuleNotFoundError as e:\n    print(e)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (0, "")
    return proc.stdout


def kill_at_step(
    argv: list[str], run_dir: Path, at: int, *, committed: int | None = None, timeout: float = 300.0, **popen: Any
) -> None:
    """Start ``argv``; SIGKILL it once ``run_dir``'s history holds a step row of step ``at`` or later
    and, with ``committed``, checkpoint ``committed`` is committed (its container, written last, is
    there). A background save may still be writing that checkpoint when later steps' rows appear: a
    test that means "killed after the checkpoint" says which one."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **popen)
    deadline = time.monotonic() + timeout
    saved = None if committed is None else run_dir / checkpoint_name(committed)

    def reached() -> bool:
        if saved is not None and not saved.exists():
            return False
        return any(r["kind"] == "step" and r["step"] >= at for r in _rows_so_far(run_dir))

    try:
        while not reached():
            assert proc.poll() is None, f"the run ended before step {at}: {proc.communicate()[1][-2000:]!r}"
            assert time.monotonic() < deadline, f"step {at} not reached in {timeout} s"
            time.sleep(0.002)
    finally:
        proc.kill()
        proc.communicate()


def _rows_so_far(run_dir: Path) -> list[dict[str, Any]]:
    try:
        return read_rows(run_dir / "history.jsonl")[0]
    except FileNotFoundError:
        return []
