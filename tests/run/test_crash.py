"""Crash safety with real processes: SIGKILL a saving run anywhere, resume, lose nothing.

One *lab* subprocess (``python tests/run/test_crash.py lab DIR``) imports torch once and
forks every process below, so each experiment costs milliseconds, not an import:

* **traced kills** -- a victim resumes a run at step 2 and saves steps 3 and 4
  (``RunState.save``: config snapshot, ``.ngram`` sidecar, container, retention
  with ``keep=2``). Every file operation ckptkit makes (temp create, write,
  pwrite, fsync, rename, directory fsync, unlink) is an *event*; experiment *k*
  SIGKILLs the victim just before event *k* -- and, for some writes, after
  writing half of event *k*'s buffer (a torn temp file). Every non-write event
  of both saves is a kill point, and a sample of the writes
  (``CKPTKIT_CRASH_FULL=1``: every event, every write torn). The same again
  with ``RunState(async_save=True)``, whose background writer is the one killed.
* **external kills** -- a victim with a 3 MiB model saves steps 3..8 in a loop
  and the lab SIGKILLs it from outside, after a random delay or the moment the
  container's temp file passes half its final size.

After each kill a fresh *checker* process verifies that the newest ``keep``
committed checkpoints (and their companions) are intact, ``RunState.resume()``
picks the newest committed step and restores state bit-identical to a run that
was never killed, the killed save's temp files are gone, and training on to
step 5 (or 9) ends bit-identical to the reference with a tidy run directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEEP = 2
BASE_STEPS = 2  # committed before any victim runs
TRACED_SAVES = (3, 4)
TRACED_FINAL = 5
EXTERNAL_SAVES = tuple(range(3, 9))
EXTERNAL_FINAL = 9


# =================================================================== the lab (child side)


def _lab_main(work: str, external_kills: int, seed: int) -> None:
    import builtins
    import dataclasses
    import inspect
    import random
    import re
    import shutil
    import signal
    import time

    import torch
    import xxhash

    import ckptkit
    from ckptkit.format._sidecar import verify_sidecar
    from ckptkit.run import RunState, list_checkpoints

    torch.set_num_threads(1)

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        width: int = 16  # hidden units
        lr: float = 1e-2
        steps: int = 10

    class Run:
        """Everything the tiny run has: a model, AdamW, a data position and an n-gram table."""

        def __init__(self, run_dir: str, width: int, async_save: bool = False) -> None:
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, width),
                torch.nn.Tanh(),
                torch.nn.Linear(width, width),
                torch.nn.Tanh(),
                torch.nn.Linear(width, 4),
            )
            self.opt = torch.optim.AdamW(self.net.parameters(), lr=1e-2)
            self.offset = 0
            self.table_step = 0
            self.counts = torch.zeros(16, dtype=torch.int64)
            extra: dict[str, Any] = {"async_save": True} if async_save else {}
            self.rs = rs = RunState(run_dir, config=Cfg(width=width), keep=KEEP, **extra)
            rs.add_model("net", self.net)
            rs.add_optimizer("adamw", self.opt)
            rs.add_data_position("train", get=lambda: self.offset, set=self._seek, expected=lambda s, _values: 32 * s)
            rs.add_sidecar("ngram", get=lambda: (self.table_step, {"counts": self.counts.clone()}), set=self._set_table)

        def _seek(self, v: int) -> None:
            self.offset = v

        def _set_table(self, table_step: int, tree: dict) -> None:
            self.table_step = table_step
            self.counts = tree["counts"].clone()

        def step(self, s: int) -> None:
            g = torch.Generator().manual_seed(1000 + s)
            x = torch.randn(32, 8, generator=g)
            y = torch.randn(32, 4, generator=g)
            self.opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(self.net(x), y).backward()
            self.opt.step()
            self.offset += 32
            self.table_step += 1
            self.counts[s % 16] += s

        def fingerprint(self) -> str:
            h = xxhash.xxh3_64()
            for sd in (self.net.state_dict(), self.opt.state_dict()["state"]):
                for k in sorted(sd):  # optimizer state keys sorted: a reload may reorder them
                    vals = [sd[k][kk] for kk in sorted(sd[k])] if isinstance(sd[k], dict) else [sd[k]]
                    for t in vals:
                        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            h.update(f"{self.offset} {self.table_step}".encode())
            h.update(self.counts.numpy().tobytes())
            return h.hexdigest()

    def reference(width: int, last: int) -> dict[int, str]:
        r = Run(os.path.join(work, "unused"), width)
        out = {}
        for s in range(1, last + 1):
            r.step(s)
            out[s] = r.fingerprint()
        return out

    # --------------------------------------------------------------- tracing

    real = {
        "write": os.write,
        "pwrite": os.pwrite,
        "fsync": os.fsync,
        "replace": os.replace,
        "unlink": os.unlink,
        "open": os.open,
        "bopen": builtins.open,
    }
    tmp_re = re.compile(r"^\.(.+)\.tmp\.\d+\.[0-9a-f]{8}$")

    def part_of(name: str) -> str:
        m = tmp_re.match(name)
        base = m.group(1) if m else name
        step = re.search(r"step-(\d+)", base)
        kind = (
            "snapshot"
            if base.endswith(".config.json")
            else "sidecar"
            if base.endswith(".ngram")
            else "container"
            if base.endswith(".ckpt")
            else "other"
        )
        return f"{kind}@{int(step.group(1)) if step else '-'}"

    class Tracer:
        def __init__(self, kill_at: int | None, half: bool) -> None:
            self.n = 0
            self.kill_at, self.half = kill_at, half
            self.events: list[tuple[str, str]] = []
            self.last_part = "other@-"

        def event(self, op: str, part: str, partial: tuple | None = None) -> None:
            if op not in ("dirsync",):
                self.last_part = part
            self.events.append((op, part))
            if self.n == self.kill_at:
                if self.half and partial is not None:
                    fn, args = partial
                    fn(*args)
                os.kill(os.getpid(), signal.SIGKILL)
            self.n += 1

        def fd_part(self, fd: int) -> str | None:
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                return None
            if not target.startswith(work):
                return None
            if os.path.isdir(target):
                return "dir"
            return part_of(os.path.basename(target))

        def install(self) -> None:
            t = self

            def write(fd, data):
                part = t.fd_part(fd)
                if part is not None and part != "dir":
                    mv = memoryview(data)
                    t.event("write", part, (real["write"], (fd, mv[: len(mv) // 2])))
                return real["write"](fd, data)

            def pwrite(fd, data, offset):
                part = t.fd_part(fd)
                if part is not None and part != "dir":
                    mv = memoryview(data)
                    t.event("pwrite", part, (real["pwrite"], (fd, mv[: len(mv) // 2], offset)))
                return real["pwrite"](fd, data, offset)

            def fsync(fd):
                part = t.fd_part(fd)
                if part == "dir":
                    t.event("dirsync", t.last_part)
                elif part is not None:
                    t.event("fsync", part)
                return real["fsync"](fd)

            def replace(src, dst, **kw):
                if os.fspath(dst).startswith(work):
                    t.event("rename", part_of(os.path.basename(os.fspath(dst))))
                return real["replace"](src, dst, **kw)

            def unlink(path, **kw):
                if os.fspath(path).startswith(work):
                    t.event("unlink", "retention:" + part_of(os.path.basename(os.fspath(path))))
                return real["unlink"](path, **kw)

            def bopen(file, mode="r", *a, **kw):
                if isinstance(file, str) and file.startswith(work) and ("x" in mode or "w" in mode):
                    t.event("create", part_of(os.path.basename(file)))
                return real["bopen"](file, mode, *a, **kw)

            os.write, os.pwrite, os.fsync, os.replace, os.unlink = write, pwrite, fsync, replace, unlink
            builtins.open = bopen

    # --------------------------------------------------------------- processes

    def fork(fn) -> int:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                fn()
                code = 0
            except BaseException:  # noqa: BLE001 - report and die, never return into the lab
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        return pid

    def wait(pid: int) -> int:
        _, status = os.waitpid(pid, 0)
        return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)

    def make_base(run_dir: str, width: int) -> None:
        def go():
            r = Run(run_dir, width)
            r.rs.start()
            for s in range(1, BASE_STEPS + 1):
                r.step(s)
                r.rs.save(s)

        assert wait(fork(go)) == 0, "base run failed"

    def files(run_dir: str) -> list[str]:
        return sorted(os.listdir(run_dir))

    def check(
        run_dir: str, width: int, ref: dict[int, str], committed: list[int], final: int, resumed_in: tuple[int, ...]
    ) -> dict:
        """In a fresh process: what survived the kill, what resume does, how the run ends."""
        out_path = os.path.join(work, "check.json")

        def go():
            problems, orphans = [], []
            # 1. the newest KEEP committed checkpoints are intact, companions included
            for s in committed[-KEEP:]:
                p = os.path.join(run_dir, f"step-{s:08d}.ckpt")
                rep = ckptkit.verify(p) if os.path.exists(p) else None
                if rep is None or not rep.ok:
                    problems.append(f"committed step {s} lost or damaged: {rep and rep.error}")
                    continue
                if not os.path.exists(p + ".config.json"):
                    problems.append(f"committed step {s}: snapshot missing")
                try:
                    verify_sidecar(p + ".ngram", expect_step=s)
                except ckptkit.CheckpointError as e:
                    problems.append(f"committed step {s}: sidecar: {e}")
            # 2. resume picks the newest committed step, restores the exact state
            r = Run(run_dir, width)
            info = r.rs.resume()
            if info.step not in resumed_in:
                problems.append(f"resumed at step {info.step}, expected one of {resumed_in}")
            if r.fingerprint() != ref[info.step]:
                problems.append(f"state restored at step {info.step} differs from the uninterrupted run")
            temps = [n for n in files(run_dir) if ".tmp." in n]
            if temps:
                problems.append(f"temp files left after resume: {temps}")
            # 3. the run goes on and ends where the uninterrupted run ends, bit for bit
            for s in range(info.step + 1, final + 1):
                r.step(s)
                r.rs.save(s)
            if r.fingerprint() != ref[final]:
                problems.append("final state differs from the uninterrupted run")
            r2 = Run(run_dir, width)
            if r2.rs.resume().step != final or r2.fingerprint() != ref[final]:
                problems.append("the final checkpoint does not resume to the reference state")
            # 4. a tidy directory: the retained checkpoints, their companions, nothing else
            kept = [s for s, _ in list_checkpoints(run_dir)]
            want = {"environment.json", "lease.json"}  # r2 is open: its job holds the directory (spec/lease.md)
            for s in kept:
                n = f"step-{s:08d}.ckpt"
                want |= {n, n + ".config.json", n + ".ngram"}
            extra = sorted(set(files(run_dir)) - want)
            if kept != list(range(final - KEEP + 1, final + 1)):
                problems.append(f"retained steps {kept}, expected the newest {KEEP}")
            if any(".tmp." in n for n in extra):
                problems.append(f"temp files left after the next saves: {extra}")
            orphans = [n for n in extra if ".tmp." not in n]
            with real["bopen"](out_path, "w") as f:
                json.dump({"problems": problems, "orphans": orphans, "resumed": info.step}, f)

        code = wait(fork(go))
        if code != 0:
            return {"problems": [f"checker process failed (exit {code})"], "orphans": [], "resumed": None}
        with open(out_path) as f:
            return json.load(f)

    results: dict = {"traced": [], "external": []}

    # --------------------------------------------------------------- traced kills
    small_ref = reference(16, TRACED_FINAL)
    base_dir = os.path.join(work, "base-small")
    make_base(base_dir, 16)

    def victim(
        run_dir: str,
        width: int,
        saves: tuple[int, ...],
        tracer: Tracer | None,
        progress: str | None,
        async_save: bool = False,
    ):
        def go():
            r = Run(run_dir, width, async_save=async_save)
            r.rs.resume()
            if tracer is not None:
                tracer.install()
            for s in saves:
                r.step(s)
                r.rs.save(s)
                if progress:
                    with real["bopen"](progress, "a") as f:
                        f.write(f"{s}\n")
            if async_save:
                r.rs.close()  # the last background write is committed once close() returns
            if tracer is not None:
                with real["bopen"](os.path.join(work, "trace.json"), "w") as f:
                    json.dump(tracer.events, f)

        return go

    def traced_series(key: str, async_save: bool, write_every: int, torn_every: int) -> None:
        """Dry-run the two saves to list their events, then kill at each chosen one."""
        dry = os.path.join(work, f"dry-{key}")
        shutil.copytree(base_dir, dry)
        assert wait(fork(victim(dry, 16, TRACED_SAVES, Tracer(None, False), None, async_save))) == 0
        with open(os.path.join(work, "trace.json")) as f:
            events = [tuple(e) for e in json.load(f)]
        results[f"events-{key}"] = events
        committed_after: list[int] = []  # committed_after[k]: newest step committed before event k
        newest = BASE_STEPS
        for op, part in events:
            committed_after.append(newest)
            if op == "rename" and part.startswith("container@"):
                newest = int(part.split("@")[1])
        committed_after.append(newest)
        # Kill points: every non-write event (create, fsync, rename, dir fsync, unlink) of
        # both saves; every `write_every`-th write or pwrite, killed before it; every
        # `torn_every`-th write of the first save, killed after writing half its buffer.
        # CKPTKIT_CRASH_FULL=1: every event of both saves, every write torn.
        full = os.environ.get("CKPTKIT_CRASH_FULL") == "1"
        first = f"@{TRACED_SAVES[0]}"
        writes = [k for k, (op, _) in enumerate(events) if op in ("write", "pwrite")]
        plan = [
            (k, False)
            for k, (op, _) in enumerate(events)
            if full or op not in ("write", "pwrite") or writes.index(k) % write_every == 0
        ]
        plan += [(len(events), False)]
        plan += [
            (k, True) for i, k in enumerate(writes) if full or (events[k][1].endswith(first) and i % torn_every == 1)
        ]
        for i, (k, half) in enumerate(plan):
            run_dir = os.path.join(work, f"{key}-{i}")
            shutil.copytree(base_dir, run_dir)
            code = wait(fork(victim(run_dir, 16, TRACED_SAVES, Tracer(k, half), None, async_save)))
            newest = committed_after[k]
            committed = list(range(1, newest + 1))
            res = check(run_dir, 16, small_ref, committed, TRACED_FINAL, (newest,))
            if k < len(events) and code != -9:
                res["problems"].append(f"victim was not killed (exit {code})")
            label = "end" if k == len(events) else f"{events[k][0]} {events[k][1]}"
            results[key].append({"kill_at": k, "half": half, "event": label, **res})
            shutil.rmtree(run_dir)

    traced_series("traced", async_save=False, write_every=4, torn_every=3)
    results["events"] = results["events-traced"]
    if "async_save" in inspect.signature(RunState).parameters:
        results["traced-async"] = []
        traced_series("traced-async", async_save=True, write_every=16, torn_every=1000)

    # --------------------------------------------------------------- external kills
    big_ref = reference(512, EXTERNAL_FINAL)
    big_base = os.path.join(work, "base-big")
    make_base(big_base, 512)
    rng = random.Random(seed)
    timing = os.path.join(work, "timing")
    shutil.copytree(big_base, timing)
    t0 = time.monotonic()
    assert wait(fork(victim(timing, 512, EXTERNAL_SAVES, None, None))) == 0
    span = time.monotonic() - t0
    ckpt_size = os.path.getsize(os.path.join(timing, f"step-{EXTERNAL_SAVES[-1]:08d}.ckpt"))
    for i in range(external_kills):
        run_dir = os.path.join(work, f"external-{i}")
        shutil.copytree(big_base, run_dir)
        progress = os.path.join(work, f"progress-{i}")
        by_size = i % 2 == 1
        pid = fork(victim(run_dir, 512, EXTERNAL_SAVES, None, progress))
        how = ""
        if by_size:
            # kill when the container temp of the n-th save passes half its final size
            target = EXTERNAL_SAVES[rng.randrange(len(EXTERNAL_SAVES))]
            pat = re.compile(rf"^\.step-{target:08d}\.ckpt\.tmp\.")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    hit = [e for e in os.scandir(run_dir) if pat.match(e.name) and e.stat().st_size >= ckpt_size // 2]
                except FileNotFoundError:
                    hit = []
                if hit:
                    break
            how = f"container temp of step {target} at >= {ckpt_size // 2} bytes"
        else:
            delay = rng.uniform(0, span)
            time.sleep(delay)
            how = f"after {delay * 1000:.1f} ms"
        os.kill(pid, signal.SIGKILL)
        code = wait(pid)
        done = []
        if os.path.exists(progress):
            with open(progress) as f:
                done = [int(x) for x in f.read().split()]
        last = done[-1] if done else BASE_STEPS
        # the save in flight may have committed (renamed its container) before the kill
        inflight = os.path.join(run_dir, f"step-{last + 1:08d}.ckpt")
        committed = list(range(1, last + (2 if os.path.exists(inflight) else 1)))
        allowed = (last, last + 1) if last < EXTERNAL_SAVES[-1] else (last,)
        res = check(run_dir, 512, big_ref, committed, EXTERNAL_FINAL, allowed)
        results["external"].append({"how": how, "exit": code, "returned": last, **res})
        shutil.rmtree(run_dir)
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump(results, f, indent=1)


# =================================================================== the tests (pytest side)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    work = tmp_path_factory.mktemp("crashlab")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "lab", str(work), "8", "20240611"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(work / "results.json") as f:
        return json.load(f)


def _phases(events: list) -> set[str]:
    return {f"{op} {part.split('@')[0]}" for op, part in events}


@pytest.mark.slow
def test_every_phase_of_a_runstate_save_is_a_kill_point(lab):
    phases = _phases(lab["events"])
    for want in (
        "create snapshot",
        "fsync snapshot",
        "rename snapshot",
        "dirsync snapshot",
        "create sidecar",
        "write sidecar",
        "pwrite sidecar",
        "fsync sidecar",
        "rename sidecar",
        "dirsync sidecar",
        "create container",
        "write container",
        "pwrite container",
        "fsync container",
        "rename container",
        "dirsync container",
        "unlink retention:container",
        "unlink retention:snapshot",
        "unlink retention:sidecar",
    ):
        assert want in phases, f"no kill point in phase {want!r}: {sorted(phases)}"
    assert len(lab["traced"]) >= 60, len(lab["traced"])
    assert sum(e["half"] for e in lab["traced"]) >= 10  # torn writes inside temp files


@pytest.mark.slow
def test_a_run_killed_at_any_point_of_a_save_resumes_with_nothing_lost(lab):
    bad = [e for e in lab["traced"] if e["problems"]]
    assert not bad, json.dumps(bad[:5], indent=1)


@pytest.mark.slow
def test_an_async_save_killed_at_any_point_resumes_with_nothing_lost(lab):
    """RunState(async_save=True): the background writer is killed at its file operations."""
    if "traced-async" not in lab:
        pytest.skip("RunState has no async_save")
    phases = _phases(lab["events-traced-async"])
    assert {"rename container", "write container", "rename sidecar", "unlink retention:container"} <= phases
    assert len(lab["traced-async"]) >= 30
    bad = [e for e in lab["traced-async"] if e["problems"]]
    assert not bad, json.dumps(bad[:5], indent=1)


@pytest.mark.slow
def test_a_run_killed_from_outside_resumes_with_nothing_lost(lab):
    assert len(lab["external"]) >= 8
    bad = [e for e in lab["external"] if e["problems"]]
    assert not bad, json.dumps(bad[:5], indent=1)
    assert all(e["exit"] == -9 or e["returned"] == EXTERNAL_SAVES[-1] for e in lab["external"])


@pytest.mark.slow
def test_a_killed_save_leaves_no_orphan_files_once_the_run_moves_on(lab):
    """Temp files are cleaned at resume; companions whose container is gone (a kill
    inside retention deletes the container first) must not pile up forever."""
    bad = [
        (e.get("event", e.get("how")), e["orphans"])
        for e in lab["traced"] + lab.get("traced-async", []) + lab["external"]
        if e.get("orphans")
    ]
    assert not bad, bad[:10]


# =================================================================== the reference trainer, SIGKILLed

# Beside the tiny model's flags (helpers.TINY_FLAGS, imported where used: the lab child imports only what it needs).
_TRAIN_FLAGS = [
    "--keep",
    "3",
    "--ckpt-every",
    "4",
    "--log-every",
    "1000",
    "--quiet",
]
_TRAIN_STEPS = 16


def _train_cmd(run_dir, *extra: str) -> list[str]:
    from helpers import TINY_FLAGS

    return [
        sys.executable,
        "-m",
        "ckptkit",
        "train",
        "--run-dir",
        str(run_dir),
        "--steps",
        str(_TRAIN_STEPS),
        *TINY_FLAGS,
        *_TRAIN_FLAGS,
        *extra,
    ]


def _kill_when(cmd: list[str], run_dir, ready, env) -> int:
    """Start ``cmd``, SIGKILL it once ``ready(names in run_dir)`` holds; its exit status."""
    import signal
    import time

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            names = os.listdir(run_dir) if os.path.isdir(run_dir) else []
            if ready(names):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.0005)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return proc.returncode


@pytest.mark.slow
def test_a_sigkilled_ckptkit_train_resumes_to_the_same_bytes(tmp_path):
    """``ckptkit train`` SIGKILLed twice -- while writing the step-8 container, and
    between the step-12 companions and its container (each falling back to "just
    after that checkpoint" when the poll misses the window) -- and resumed each
    time, ends with the same final checkpoint (container, snapshot, sidecar) and the
    same history rows as a run that was never killed. (Kills between checkpoints are
    covered in-process by tests/trainer/test_trainer_resume.py.)"""
    from ckptkit.run import checkpoint_name, compared_rows, read_rows

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    reference = subprocess.Popen(_train_cmd(ref), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    c8, c12 = checkpoint_name(8), checkpoint_name(12)
    # The first two aim inside a save; polling may miss a window that short, so
    # each falls back to "just after that checkpoint" rather than never firing.
    triggers = [
        (
            "in the step-8 container write (or just after it)",
            lambda names: any(n.startswith(f".{c8}.tmp.") for n in names) or c8 in names,
            False,
        ),
        (
            "between the step-12 companions and its container (or just after it)",
            lambda names: f"{c12}.ngram" in names,
            True,
        ),
    ]
    killed = []
    for what, ready, resume in triggers:
        code = _kill_when(_train_cmd(cut, *(["--resume"] if resume else [])), cut, ready, env)
        killed.append((what, code))
    done = subprocess.run(_train_cmd(cut, "--resume"), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    _, ref_err = reference.communicate(timeout=300)
    assert reference.returncode == 0, ref_err[-3000:]
    assert [c for _, c in killed] == [-9, -9], killed  # each trigger fired before the run finished
    final = checkpoint_name(_TRAIN_STEPS)
    for name in (final, final + ".config.json", final + ".ngram"):
        assert (cut / name).read_bytes() == (ref / name).read_bytes(), f"{name} differs after {killed}"
    rows_ref, _ = read_rows(ref / "history.jsonl")
    rows_cut, _ = read_rows(cut / "history.jsonl")
    assert compared_rows(rows_cut) == compared_rows(rows_ref)
    assert not [n for n in os.listdir(cut) if ".tmp." in n]


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "lab":
        _lab_main(
            sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 12, int(sys.argv[4]) if len(sys.argv) > 4 else 0
        )
    else:
        sys.exit("usage: python tests/run/test_crash.py lab WORKDIR [EXTERNAL_KILLS] [SEED]")
