"""Rank-side script of tests/run/test_multinode.py: run on each node of a 2-node torchrun job, in a
working directory of its own, with ``python tests/_multinode_worker.py s3://bucket/prefix [TRAIN...]``.

First, given ``TRAIN`` (``ckptkit train``'s arguments), it runs the reference trainer in this
process, in the job's process group (one job less to start: the suite's time is short). Then it
checks, on 2 nodes that share no local path, ``ckptkit.distributed.save/load`` and ``AsyncSaver``
on object storage, and a ``RunState`` loop (FSDP2, a teacher, per-rank values) interrupted after
step 4 and resumed, against the same loop uninterrupted. It prints one ``MULTINODE OK rank R``
line, or raises.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tests' own helpers

import torch
import torch.distributed as dist
from _runstate_workers import _differs, train

import ckptkit.distributed as ckd
from ckptkit.distributed._objects import RemoteCheckpoint


def _plain(url: str, rank: int, world: int) -> None:
    """Each rank's own tensor, a replicated one and a plain value: saved by both nodes, one record."""
    state: dict[str, Any] = {f"w{rank}": torch.full((5,), float(rank + 1)), "shared": torch.arange(6.0), "step": 3}
    ckd.save(state, f"{url}/plain/step-1")
    saver = ckd.AsyncSaver()
    saver.save(state, f"{url}/plain/step-2")
    saver.wait()
    saver.close()
    for name in ("step-1", "step-2"):
        out: dict[str, Any] = {f"w{rank}": torch.zeros(5), "shared": torch.zeros(6), "step": 0}
        ckd.load(out, f"{url}/plain/{name}")
        assert torch.equal(out[f"w{rank}"], state[f"w{rank}"]) and torch.equal(out["shared"], state["shared"])
        assert out["step"] == 3, out
        listed = sorted(RemoteCheckpoint.at(f"{url}/plain/{name}").entries())
        assert listed == [name, *(f"{name}.rank-{r:05d}.ckdcp" for r in range(world))], listed


def main(url: str, trainer: list[str]) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, world
    if trainer:
        from ckptkit.cli import main as cli

        code = cli(["train", *trainer])
        assert code == 0, f"ckptkit train exited {code}"
    torch.set_num_threads(1)
    _plain(url, rank, world)
    straight = train(f"{url}/straight", "fsdp2", 6)
    train(f"{url}/resumed", "fsdp2", 4, async_save=True)
    resumed = train(f"{url}/resumed", "fsdp2", 6)
    differ = _differs(resumed, straight)
    assert not differ, differ
    dist.barrier()
    dist.destroy_process_group()
    print(f"MULTINODE OK rank {rank}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
