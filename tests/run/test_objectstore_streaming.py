"""A save, a load and a run's resume on ``s3://`` hold a few parts in memory, never the checkpoint
(spec/objectstore.md R-O51): each is measured in a child process of its own, whose peak resident
memory a whole-in-RAM copy of the 64 MiB checkpoint would raise by at least 64 MiB."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptkit

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")  # botocore's pooled sockets at exit

WORKER = Path(__file__).resolve().parents[1] / "_memory_worker.py"
MIB, PART_MIB, THREADS = 64, 8, 2  # the bound: 2 parts of 8 MiB in flight, 16 MiB
#: The parts in flight twice over and 16 MiB for the client's and the allocator's own buffers:
#: 48 MiB, under the 64 MiB one whole copy of the checkpoint adds (measured: 12..17 MiB).
ALLOWED = (2 * PART_MIB * THREADS + 16) << 20


def _grew(what: str, place: str) -> int:
    """The peak memory ``what`` added in a fresh process (tests/_memory_worker.py); its result checked."""
    proc = subprocess.run(
        [sys.executable, str(WORKER), what, place, str(MIB), str(PART_MIB), str(THREADS)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = proc.stdout.split()
    assert words[2:] == ["intact", "True"], proc.stdout
    return int(words[1])


@pytest.mark.slow
def test_a_save_a_load_and_a_resume_on_s3_hold_a_few_parts_not_the_checkpoint(s3: str, tmp_path: Path) -> None:
    run, local = f"{s3}/run", str(tmp_path / "run")
    assert _grew("save", run) < ALLOWED  # the run store's upload
    assert _grew("load", run) < ALLOWED  # ckptkit.load(url, into=...): a local load adds nothing
    _local_run(local)
    assert _grew("resume", run) - _grew("resume", local) < ALLOWED  # a resume makes one copy of its own


def _local_run(run_dir: str) -> None:
    """The worker's run, saved here: step 1 of the same weights in a local run directory."""
    net = torch.nn.Module()
    net.w = torch.nn.Parameter(torch.arange(MIB << 18, dtype=torch.float32))
    rs = ckptkit.RunState(run_dir, config={}, keep=1)
    rs.add_model("net", net)
    rs.start()
    rs.save(1)
    rs.close()
