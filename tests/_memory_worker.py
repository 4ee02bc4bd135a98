"""A child process that saves, loads or resumes one checkpoint and prints how much its peak
resident memory grew doing it (tests/run/test_objectstore_streaming.py, spec/objectstore.md R-O51).

    python _memory_worker.py save|load|resume RUN MIB PART_MIB THREADS

``save`` starts the run ``RUN`` (an ``s3://`` prefix or a local directory) and saves step 1,
``load`` reads that step's checkpoint into the weights, ``resume`` resumes the run: each of
``MIB`` MiB of float32 weights, whose objects go up and come down in parts of ``PART_MIB`` MiB,
``THREADS`` at a time. The weights exist before the baseline is taken (a load or resume fills
them in place), so ``grew <bytes>`` is what reading or writing them held at its peak.
"""

from __future__ import annotations

import contextlib
import re
import sys

import torch

import ckptkit
from ckptkit.format import _objectstore


def _peak() -> int:
    """This program's peak resident memory (Linux's ``VmHWM``; ``ru_maxrss`` would start at the
    parent's, carried across fork and exec)."""
    with open("/proc/self/status") as f:
        found = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M)
    assert found is not None
    return int(found[1]) * 1024


class Net(torch.nn.Module):
    def __init__(self, mib: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(mib << 18, dtype=torch.float32))


def main() -> None:
    what, url, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
    _objectstore.PART_SIZE, _objectstore._THREADS = int(sys.argv[4]) << 20, int(sys.argv[5])
    net = Net(mib)
    with contextlib.suppress(ckptkit.CheckpointNotFound):  # imports and the S3 client, before the baseline
        ckptkit.verify(f"{url}/none.ckpt")
    rs = ckptkit.RunState(url, config={}, keep=1)
    rs.add_model("net", net)
    if what != "save":
        with torch.no_grad():
            net.w.zero_()
    before = _peak()
    if what == "save":
        rs.start()
        rs.save(1)
    elif what == "load":
        ckptkit.load(f"{url}/step-00000001.ckpt", into={"model": {"net": net.state_dict()}})
    else:
        assert rs.resume().step == 1
    grew = _peak() - before
    rs.close()
    intact = torch.equal(net.w, torch.arange(mib << 18, dtype=torch.float32))
    print(f"grew {grew} intact {intact}")


if __name__ == "__main__":
    main()
