"""The run directory as a state machine (spec/runstate.md R-023, R-025..R-027; guarantees.md G-40..G-42).

A hypothesis ``RuleBasedStateMachine`` saves, puts special files in place of any file, crashes
mid-save with a real SIGKILL, resumes and verifies, against the model of what a resume must take:
never a hang, never a raw exception, and the resume takes exactly the newest checkpoint
``ckptkit verify`` passes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import tempfile
from pathlib import Path
from typing import Any

import torch
from _run_dir import ROOT_USER, failed, make_run, make_special, no_hang, resume_run, verify_run
from helpers import examples
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ckptkit import CheckpointError, NoConsistentCheckpoint
from ckptkit.run import RunState
from ckptkit.run._lease import LEASE_FILE

# --------------------------------------------------------------------- the state machine


SPECIALS = ["fifo", "directory", "devzero", "garbage", *(["unreadable"] if not ROOT_USER else [])]


def _crash_in_save(rs: RunState, step: int, at: int) -> None:
    """Save ``step`` in a child process that SIGKILLs itself before its ``at``-th rename: a real death mid-save."""
    pid = os.fork()
    if pid == 0:  # the child: count renames, die at the chosen one
        real, calls = os.replace, [0]

        def replace(src: Any, dst: Any, **kw: Any) -> None:
            calls[0] += 1
            if calls[0] == at:
                os.kill(os.getpid(), signal.SIGKILL)
            real(src, dst, **kw)

        os.replace = replace
        try:
            rs.save(step)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


class RunDirectory(RuleBasedStateMachine):
    """Saves, special files in place of any file, crashes mid-save, resumes, verifies: never a
    hang, never a raw exception, and the resume takes exactly the newest checkpoint verify passes."""

    def __init__(self) -> None:
        super().__init__()
        self.top = Path(tempfile.mkdtemp(prefix="ckptkit-machine-"))
        self.run = self.top / "run"
        self.rs: RunState | None
        self.rs, self.net = make_run(self.run)
        self.rs.start()
        self.step = 0

    def teardown(self) -> None:
        for p in self.top.rglob("*"):
            with contextlib.suppress(OSError):
                if not p.is_symlink() and stat.S_IMODE(p.stat().st_mode) == 0:
                    p.chmod(0o600)
        shutil.rmtree(self.top, ignore_errors=True)

    @precondition(lambda self: self.rs is not None)
    @rule()
    def save(self) -> None:
        assert self.rs is not None
        self.step += 1
        with torch.no_grad():
            self.net.weight.add_(1.0)
        try:
            with no_hang():
                self.rs.save(self.step)
        except CheckpointError:  # a special file where the save writes (a directory): said, never raw
            self.step -= 1

    @precondition(lambda self: self.rs is not None)
    @rule(at=st.integers(1, 4))
    def crash_mid_save(self, at: int) -> None:
        assert self.rs is not None
        _crash_in_save(self.rs, self.step + 1, at)

    @rule(data=st.data(), kind=st.sampled_from(SPECIALS))
    def damage(self, data: st.DataObject, kind: str) -> None:
        # lease.json is the lease's (tests/run/test_lease.py: a damaged one is refused, naming what to do)
        names = sorted(n for n in os.listdir(self.run) if not n.startswith(".") and n != LEASE_FILE)
        if not names:
            return
        victim = self.run / data.draw(st.sampled_from(names), label="victim")
        if kind == "garbage":
            if victim.is_dir() and not victim.is_symlink():
                shutil.rmtree(victim)
            elif victim.is_symlink() or victim.exists():
                victim.unlink()
            victim.write_bytes(b"\x00garbage")
        else:
            make_special(victim, kind)

    @rule()
    def resume(self) -> None:
        self.rs, info, net = resume_run(self.run)
        _, doc = verify_run(self.run)
        passed = sorted(p for p in self._checkpoints() if p not in failed(doc))
        if self.rs is None:
            assert passed == [], (passed, info)
            assert isinstance(info, NoConsistentCheckpoint) == bool(self._checkpoints()), info
            return
        assert info.path == (passed[-1] if passed else None), (info, doc)
        self.net = net
        self.step = info.step

    def _checkpoints(self) -> list[str]:
        return sorted(str(self.run / n) for n in os.listdir(self.run) if n.startswith("step-") and n.endswith(".ckpt"))

    @invariant()
    def verify_never_raises(self) -> None:
        code, _ = verify_run(self.run)
        assert code in (0, 1) or not self._checkpoints()


RunDirectory.TestCase.settings = settings(
    max_examples=examples(1.5),
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_the_run_directory_state_machine = RunDirectory.TestCase
