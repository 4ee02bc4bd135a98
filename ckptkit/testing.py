"""Test helpers for other trainers' CI: prove that a resume is the same run.

Give ckptkit two functions of yours and it checks, bit for bit, that a run
interrupted at arbitrary steps and resumed equals the uninterrupted run:

* ``make_run(config, run_dir)`` builds everything (model, optimizer, data, ...) and
  returns an object whose ``state`` attribute is the :class:`~ckptkit.RunState` with
  all of it registered;
* ``step(run, i)`` performs training step ``i`` (0-based); what it returns (a loss) is ignored.

Copy-paste pytest example (see ``examples/test_resumable_loop.py``)::

    from hypothesis import given
    from ckptkit.testing import assert_resume_equivalent, assert_step_leaves_global_rng_alone, interruptions

    @given(stops=interruptions(steps=12))
    def test_resumed_equals_uninterrupted(tmp_path_factory, stops):
        assert_resume_equivalent(make_run, train_step, Config(), steps=12, stops=stops,
                                 workdir=tmp_path_factory.mktemp("resume"))

    def test_a_step_touches_no_global_rng(tmp_path):
        run = make_run(Config(), tmp_path)
        assert_step_leaves_global_rng_alone(lambda: train_step(run, 0))

The field-coverage check for your config type is :func:`ckptkit.assert_field_coverage`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from .guard._faults import GradSpike
from .run import RunState
from .run._rng import global_rng_state

__all__ = [
    "GradSpike",
    "Run",
    "assert_command_resumes",
    "assert_resume_equivalent",
    "assert_step_leaves_global_rng_alone",
    "interruptions",
]


class Run(Protocol):
    """What ``make_run`` returns: anything with the run's :class:`RunState` as ``state``."""

    state: RunState


# The caller's own run type: `step` may use everything `make_run`'s objects carry, not only `state`.
_RunT = TypeVar("_RunT", bound=Run)


def _train(
    make_run: Callable[[Any, Path], _RunT],
    step: Callable[[_RunT, int], object],
    config: Any,
    run_dir: Path,
    steps: int,
    stops: Collection[int],
) -> str:
    run = make_run(config, run_dir)
    run.state.start()
    for i in range(steps):
        if i in stops:
            run.state.save(i)
            del run  # the process "dies": nothing in memory survives
            run = make_run(config, run_dir)
            info = run.state.resume()
            if info.step != i:
                raise AssertionError(f"resume after a save at step {i} came back at step {info.step}")
        step(run, i)
    return run.state.save(steps)


def _files(path: str) -> dict[str, bytes]:
    """The checkpoint and its companions (snapshot, sidecars), by suffix."""
    directory, name = os.path.split(path)
    out = {}
    for other in sorted(os.listdir(directory)):
        if other.startswith(name):
            with open(os.path.join(directory, other), "rb") as f:
                out[other[len(name) :] or ".ckpt"] = f.read()
    return out


def assert_resume_equivalent(
    make_run: Callable[[Any, Path], _RunT],
    step: Callable[[_RunT, int], object],
    config: Any,
    *,
    steps: int,
    stops: Sequence[int],
    workdir: str | os.PathLike[str],
) -> None:
    """Assert that stopping at ``stops`` and resuming gives the uninterrupted run's bytes.

    Runs ``steps`` steps twice in fresh run directories under ``workdir``: once
    straight through, once saving at every step in ``stops``, dropping every object
    and resuming through ``make_run`` + ``RunState.resume()``. The final checkpoints
    (container, snapshot and sidecars) must be byte-identical.

    Raises:
        AssertionError: naming the files that differ and, for the container, every
            tensor or value that differs (via :mod:`ckptkit.audit._compare`).
    """
    if any(not 0 < s < steps for s in stops):
        raise ValueError(f"stops must lie in 1..{steps - 1} (got {sorted(stops)})")
    workdir = Path(workdir)
    straight = _train(make_run, step, config, workdir / "uninterrupted", steps, ())
    resumed = _train(make_run, step, config, workdir / "resumed", steps, set(stops))
    a, b = _files(straight), _files(resumed)
    differing = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if not differing:
        return
    lines = [f"resumed at {sorted(stops)} differs from the uninterrupted run in {', '.join(differing)}"]
    if ".ckpt" in differing:
        from .audit._compare import compare_checkpoints

        for d in compare_checkpoints(straight, resumed)[:20]:
            lines.append(f"  {d.kind:<8} {d.name}: {d.detail}")
    lines.append(_RECIPES)
    raise AssertionError("\n".join(lines))


_RECIPES = (
    "usual causes: the data position is not registered (a shuffled DataLoader: make its order a function "
    "of (seed, epoch) and register the batches read with add_data_position, docs/adopting.md); a draw from "
    "the global generator in the step (nn.Dropout, torch.randn: wrap the step in "
    "`with ckptkit.step_rng(seed, step):`); state not registered (scheduler, scaler, EMA copy)"
)


def assert_command_resumes(
    command: Sequence[str],
    kills: Sequence[int],
    *,
    resume_args: Sequence[str] = (),
    workdir: str | os.PathLike[str] | None = None,
    timeout: float = 600.0,
) -> None:
    """Assert that a training command SIGKILLed at ``kills`` and resumed is the uninterrupted run.

    Any command that records its run with ckptkit (``RunState.record``, the Hugging Face,
    Lightning or torchtitan plug-ins, ``ckptkit train``) and puts its run directory where
    ``{run_dir}`` stands: it runs once straight through, and once SIGKILLed as its history
    reaches each step of ``kills`` (a checkpoint committed or not) and started again each time
    with the same command plus ``resume_args``. The two runs' rows and checkpoints are compared
    bit for bit by the audit's engine (:func:`ckptkit.audit.audit_crashes`).

    Example (pytest, with :func:`interruptions` choosing the moments)::

        @given(kills=interruptions(steps=20))
        def test_my_trainer_resumes_bitwise(kills, tmp_path_factory):
            assert_command_resumes(["python", "train.py", "--out", "{run_dir}"], kills,
                                   workdir=tmp_path_factory.mktemp("runs"))

    Args:
        workdir: keep the two runs in ``workdir/a`` and ``workdir/b`` (new or empty); default: a
            temporary directory, removed after.

    Raises:
        AssertionError: the runs differ: the audit's report, naming the first step and field or
            tensor that differs, and where each kill landed.
        AuditError: the command failed, timed out, saved no checkpoint, or ended before a kill step.
    """
    from .audit import audit_crashes

    keep = None if workdir is None else os.fspath(workdir)
    report = audit_crashes(command, kills, resume_args=resume_args, timeout=timeout, keep_dir=keep)
    if not report.ok:
        raise AssertionError(report.describe())


def interruptions(steps: int, max_stops: int = 3) -> Any:
    """A hypothesis strategy: sorted, distinct stop steps in ``1..steps-1`` (at least one)."""
    from hypothesis import strategies as st

    if steps < 2:
        raise ValueError(f"steps must be >= 2 to interrupt a run (got {steps})")
    return st.lists(st.integers(1, steps - 1), min_size=1, max_size=max_stops, unique=True).map(sorted)


def assert_step_leaves_global_rng_alone(fn: Callable[[], Any]) -> None:
    """Assert ``fn()`` neither reads-and-advances nor reseeds a global RNG.

    Checks Python's ``random``, numpy's legacy global generator and torch's CPU (and,
    when initialised, CUDA) generators. A step whose randomness comes from
    ``(seed, step)`` (:mod:`ckptkit.run._rng`) leaves all of them alone.

    Raises:
        AssertionError: naming each global generator that changed.
    """
    before = global_rng_state()
    fn()
    after = global_rng_state()
    changed = [k for k in before if _differs(before[k], after.get(k))]
    if changed:
        raise AssertionError(
            f"the step changed global RNG state: {', '.join(changed)}; draw from "
            "ckptkit.torch_generator(seed, step, stream) instead of the global generator, or wrap the "
            "draws you cannot hand a generator (nn.Dropout, torch.randn) in `with ckptkit.step_rng(seed, step):`"
        )


def _differs(a: Any, b: Any) -> bool:
    import numpy as np
    import torch

    if isinstance(a, dict):
        return a.keys() != b.keys() or any(_differs(a[k], b[k]) for k in a)
    if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):  # CUDA: one state per device
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return not torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return not np.array_equal(a, b)
    return bool(a != b)
