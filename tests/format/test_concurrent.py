"""Concurrent readers never see a half-written checkpoint (spec/guarantees.md, "Readers").

A writer *process* saves over the same path again and again (temp file, fsync,
rename) while reader threads in this process ``verify``, ``load`` and run
``ckptkit verify`` on it: every read sees one whole checkpoint, old or new,
never a torn one. The same for a run directory whose retention deletes old
checkpoints under the readers' feet. Bounded: the writer does a fixed number of
saves; readers stop when it exits.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import ckptkit
from ckptkit.cli import main
from ckptkit.format._checkpoint import Checkpoint, save

_WRITER = r"""
import sys, torch
from ckptkit.format._checkpoint import Checkpoint, save
path, n = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1)
for i in range(1, n + 1):
    save(path, Checkpoint(step=i, model={"w": torch.full((200_000,), float(i))}, monitor={"i": i}),
         compression="zstd" if i % 3 == 0 else "raw")
    print(i, flush=True)
"""

_RUN_WRITER = r"""
import dataclasses, sys, torch
from ckptkit.run import RunState
@dataclasses.dataclass(frozen=True)
class Cfg:
    steps: int = 1000
run_dir, n = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1)
net = torch.nn.Linear(300, 300)
rs = RunState(run_dir, config=Cfg(), keep=2)
rs.add_model("m", net)
rs.start()
for s in range(1, n + 1):
    with torch.no_grad():
        net.weight.add_(1.0)
    rs.save(s)
"""


def _whole(ck: Checkpoint) -> None:
    assert ck.monitor == {"i": ck.step}, (ck.step, ck.monitor)
    w = ck.model["w"]
    assert w.shape == (200_000,) and bool((w == float(ck.step)).all()), ck.step


@pytest.mark.slow
def test_readers_racing_a_writer_only_ever_see_whole_checkpoints(tmp_path):
    path = str(tmp_path / "x.ckpt")
    save(path, Checkpoint(step=0, model={"w": torch.zeros(200_000)}, monitor={"i": 0}))
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, path, "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    stop = threading.Event()
    seen: dict[str, list] = {"verify": [], "load": [], "cli": [], "errors": []}

    def reader(kind: str) -> None:
        while not stop.is_set():
            try:
                if kind == "verify":
                    r = ckptkit.verify(path)
                    assert r.ok, r.error
                    seen[kind].append(r.step)
                elif kind == "load":
                    ck = ckptkit.load(path)
                    _whole(ck)
                    seen[kind].append(ck.step)
                else:
                    out, err = io.StringIO(), io.StringIO()
                    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                        rc = main(["verify", path])
                    assert rc == 0 and out.getvalue().startswith("OK"), (rc, out.getvalue(), err.getvalue())
                    seen[kind].append(rc)
            except BaseException as e:  # noqa: BLE001 - collected and asserted below
                seen["errors"].append(f"{kind}: {type(e).__name__}: {e}")
                return

    # contextlib.redirect_* is process-wide: only one thread runs the CLI.
    threads = [threading.Thread(target=reader, args=(k,)) for k in ("verify", "load", "load", "cli")]
    for t in threads:
        t.start()
    try:
        out, err = writer.communicate(timeout=240)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert writer.returncode == 0, err
    assert seen["errors"] == []
    assert out.split()[-1] == "60"
    reads = len(seen["verify"]) + len(seen["load"]) + len(seen["cli"])
    assert reads >= 20, seen
    assert len(set(seen["verify"]) | set(seen["load"])) >= 3, "readers never saw the file change"
    _whole(ckptkit.load(path))


@pytest.mark.slow
def test_verifying_a_run_directory_during_saves_and_retention_never_reports_a_torn_file(tmp_path):
    run_dir = tmp_path / "run"
    writer = subprocess.Popen(
        [sys.executable, "-c", _RUN_WRITER, str(run_dir), "80"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    codes: list[int] = []
    fails: list[str] = []
    deadline = time.monotonic() + 240
    while writer.poll() is None and time.monotonic() < deadline:
        if not any(n.endswith(".ckpt") for n in (os.listdir(run_dir) if run_dir.is_dir() else [])):
            time.sleep(0.01)
            continue
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["verify", str(run_dir)])
        codes.append(rc)
        fails += [line for line in out.getvalue().splitlines() if line.startswith("FAIL")]
        assert "internal error" not in err.getvalue(), err.getvalue()
    _, err = writer.communicate(timeout=60)
    assert writer.returncode == 0, err
    assert fails == [], fails[:5]
    assert 1 not in codes and len(codes) >= 5, codes


def test_a_checkpoint_deleted_between_listing_and_reading_does_not_stop_the_others(tmp_path, monkeypatch):
    """``ckptkit verify run/`` while retention deletes the oldest checkpoint: the
    vanished file was deleted, not corrupted; every other file is still verified
    and reported, and nothing is reported as invalid."""
    from ckptkit.cli import _verify as verify_cmd

    for s in (1, 2, 3):
        save(tmp_path / f"step-{s:08d}.ckpt", Checkpoint(step=s, model={"w": torch.ones(3)}))
    real = verify_cmd.expand_checkpoints

    def listing_then_retention(paths):
        files = real(paths)
        os.unlink(files[0])  # retention got there between the listing and the read
        return files

    monkeypatch.setattr(verify_cmd, "expand_checkpoints", listing_then_retention)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["verify", str(tmp_path)])
    assert rc != 1 and "FAIL" not in out.getvalue()
    ok = [line for line in out.getvalue().splitlines() if line.startswith("OK")]
    assert len(ok) == 2, (rc, out.getvalue(), err.getvalue())
