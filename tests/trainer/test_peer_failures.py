"""A peer's death is named as such (spec/runstate.md RS-D8): by a survivor's collective, and by
``ckptkit train`` when a node is gone during start-up, in one line, never "internal error"."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from helpers import TINY_FLAGS

from ckptkit.cli import main
from ckptkit.errors import DistributedFailure
from ckptkit.run._group import Collective


class _Gone:
    """A torch.distributed whose collectives meet a peer's closed connection (gloo's words)."""

    DistError = dist.DistError

    def all_gather_object(self, *_a: Any, **_k: Any) -> None:
        raise dist.DistBackendError("[gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]: Connection reset by peer")

    broadcast_object_list = all_gather_object


def test_a_survivor_says_its_peer_died_not_that_what_it_waited_for_failed() -> None:
    group = Collective.__new__(Collective)
    group.dist, group.group, group.rank, group.world = _Gone(), None, 1, 2  # type: ignore[assignment]
    with pytest.raises(DistributedFailure) as e:
        group.on_rank0(lambda: None, "retention")
    assert str(e.value) == (
        "rank 1: a peer of this job died or was killed: it stopped answering while this rank waited for it at "
        "'retention' (DistBackendError: [gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]: Connection reset "
        "by peer); the job stops, the checkpoints committed so far are intact: start the job again on every node "
        "(a resume continues from the newest one)"
    )


def test_a_node_gone_during_start_up_is_one_line_naming_the_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 of a 2-rank job whose rank 0 (the store's host) never comes: joined within --dist-timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens there once closed
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    argv = ["train", "--run-dir", str(tmp_path / "run"), *TINY_FLAGS, "--steps", "2", "--dist-timeout", "1"]
    assert main(argv) == 2  # trouble, as every DistributedFailure
    err = capsys.readouterr().err
    assert err.startswith(
        "ckptkit train: rank 1: a peer of this job died or was killed: it stopped answering while this rank "
        "joined the job (DistNetworkError: "
    ), err
    assert err.count("\n") == 1 and "internal error" not in err
    assert not dist.is_initialized()
