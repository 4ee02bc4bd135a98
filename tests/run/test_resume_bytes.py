"""A checkpoint's bytes are a function of the state alone, never of the run's past (R-022).

One process, a ``RunState`` loop whose optimizer creates a parameter's state late: the
parameter gets no gradient for its first ``late`` steps. The uninterrupted run and a run
stopped at any step and resumed in a new ``RunState`` write the same bytes in every later
checkpoint, although the live optimizer holds its state in creation order and the resumed
one in checkpoint order. (The 2-rank torchrun runs are in ``test_trainer_distributed.py``.)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import artifacts, examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit import RunState
from ckptkit.audit import Difference
from ckptkit.audit._commands import AuditReport
from ckptkit.run import list_checkpoints
from ckptkit.run._difference import TensorReport

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=0.01),
}


@dataclasses.dataclass
class Cfg:
    optimizer: str = "adamw"
    late: int = 1
    every: int = 2


class LateLoop:
    """Three parameters; the middle one joins the loss (and gets its first gradient) at step ``late``."""

    def __init__(self, run_dir: Path, cfg: Cfg) -> None:
        g = ckptkit.torch_generator(0, 0, stream=1)
        self.cfg = cfg
        self.first = torch.nn.Parameter(torch.randn(3, 4, generator=g))
        self.late = torch.nn.Parameter(torch.randn(4, generator=g))
        self.last = torch.nn.Parameter(torch.randn(4, 2, generator=g))
        self.opt = OPTIMIZERS[cfg.optimizer]([self.first, self.late, self.last])
        self.model = torch.nn.ParameterDict({"first": self.first, "late": self.late, "last": self.last})
        self.state = RunState(run_dir, config=cfg, keep=100, log=None)
        self.state.add_model("model", self.model)
        self.state.add_optimizer("opt", self.opt)

    def step(self, i: int) -> None:
        x = torch.randn(5, 3, generator=ckptkit.torch_generator(7, i, stream=2))
        h = x @ self.first
        if i >= self.cfg.late:
            h = h * self.late
        loss = ((h @ self.last) ** 2).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def train(self, start: int, stop: int) -> None:
        for i in range(start, stop):
            self.step(i)
            if (i + 1) % self.cfg.every == 0:
                self.state.save(i + 1)


def _checkpoints(run_dir: Path) -> dict[int, dict[str, bytes]]:
    return {s: artifacts(run_dir, s) for s, _ in list_checkpoints(run_dir)}


@settings(max_examples=examples(0.3), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    optimizer=st.sampled_from(sorted(OPTIMIZERS)),
    late=st.integers(1, 5),
    stop=st.integers(2, 9),
    every=st.integers(1, 3),
)
def test_a_run_resumed_after_late_optimizer_state_writes_the_uninterrupted_bytes(
    optimizer: str, late: int, stop: int, every: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    steps, cfg = 10, Cfg(optimizer, late, every)
    base = tmp_path_factory.mktemp("late")
    straight = LateLoop(base / "straight", cfg)
    straight.state.start()
    straight.train(0, steps)
    killed = LateLoop(base / "killed", cfg)
    killed.state.start()
    killed.train(0, stop)  # the process ends here: nothing after `stop` steps is written
    resumed = LateLoop(base / "killed", cfg)
    done = resumed.state.resume_or_start()  # killed before its first checkpoint (stop < every): a fresh start
    resumed.train(done, steps)
    a, b = _checkpoints(base / "straight"), _checkpoints(base / "killed")
    assert sorted(a) == sorted(b)
    for s in sorted(a):
        differ = [name for name in a[s] if a[s][name] != b[s].get(name)]
        assert not differ, f"step {s} (resumed from {done}): {differ} differ"


def _report(divergence: Difference) -> AuditReport:
    """A replay's report from step 20 to 40 that found ``divergence``."""
    return AuditReport(
        what="replay",
        command=("ckptkit", "train"),
        steps=40,
        resume_at=20,
        rows_compared=50,
        checkpoints_compared=2,
        divergence=divergence,
    )


def test_a_checkpoint_that_differs_only_in_bytes_is_reported_as_exactly_that() -> None:
    layout = Difference("checkpoint", 30, file="step-00000030.dcp")
    report = _report(layout)
    assert not report.ok
    assert report.describe().splitlines()[1:] == [
        (
            "DIFFERS at step 30: step-00000030.dcp differs between the recording and the replay in bytes only: "
            "the bytes differ, yet every tensor and value is equal (ckptkit diff --tensors finds nothing): the files "
            "lay out the same state differently, so a writer's order depended on the run's history, not on its "
            "state (spec/distributed.md R-DC13)"
        )
    ]
    state = Difference(
        "checkpoint", 30, tensors=(TensorReport("model.w", "1/4 elements differ"),), file="step-00000030.dcp"
    )
    text = _report(state).describe()
    assert "(every recorded row matched)" in text and "usual causes:" in text and "in bytes only" not in text
