"""The training data: one file read as an endless byte stream.

The stream's state is a single integer, ``offset``: the number of bytes consumed
since the start of the run, never reduced modulo the file size. Byte ``i`` of the
stream is ``data[i % len(data)]``, so the stream wraps around at EOF the same way
every time. A batch of ``batch`` sequences of ``seq_len`` bytes consumes exactly
``batch * seq_len`` bytes; its targets are the inputs shifted by one, the last
target peeked from the next byte without consuming it.

Stream offset rule (spec/trainer.md, design record item 6): after ``step`` steps
the offset is ``(step + pre_batches) * batch * seq_len``, where ``pre_batches`` is
the number of probe batches the run consumed before step 0.

Under torchrun (spec/trainer.md R-T14) ``batch`` is the *global* batch: rank ``r`` of
``W`` reads rows ``r * batch/W ..< (r+1) * batch/W`` of it, and the offset -- the same
on every rank -- still advances by the whole ``batch * seq_len``. A rank's batch is
then a function of (offset, rank, world size), and the offset a function of the step.
"""

from __future__ import annotations

import importlib.resources
import os

import numpy as np
import torch
import xxhash

from ..format._checks import check_int

__all__ = ["ByteStream", "data_fingerprint", "load_bytes"]


def load_bytes(path: str) -> bytes:
    """The training bytes: the file at ``path``, or the shipped corpus for ``""``.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file holds fewer than 2 bytes (nothing to predict).
    """
    if path:
        with open(os.fspath(path), "rb") as f:
            data = f.read()
    else:
        data = importlib.resources.files("ckptkit.trainer").joinpath("data/corpus.txt").read_bytes()
    if len(data) < 2:
        raise ValueError(f"--data: {path or 'corpus'} holds {len(data)} byte(s); training needs at least 2")
    return data


def data_fingerprint(data: bytes) -> dict[str, object]:
    """Size and xxh3-64 of the training bytes: stored with the run so a resume on
    other bytes (same path, edited file) is refused rather than trained on."""
    return {"bytes": len(data), "xxh3_64": f"0x{xxhash.xxh3_64_intdigest(data):016x}"}


class ByteStream:
    """An endless, deterministic stream over ``data``; its whole state is :attr:`offset`."""

    def __init__(self, data: bytes, *, rank: int = 0, world: int = 1) -> None:
        self._data = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))
        self.offset = 0  # bytes of the global batches consumed since the run started (absolute, not wrapped)
        self.rank, self.world = rank, world  # which rows of each global batch this process reads

    def seek(self, offset: int) -> None:
        """Put the stream at an absolute offset (restoring a checkpoint)."""
        self.offset = check_int("stream offset", offset)

    def next_batch(self, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the next global batch as ``(inputs, targets)``, each
        ``(batch / world, seq_len)`` int64; consumes the whole batch's ``batch * seq_len`` bytes."""
        rows = batch // self.world
        n = rows * seq_len
        where = (self.offset + self.rank * n + torch.arange(n + 1)) % self._data.numel()
        chunk = self._data[where]
        self.offset += batch * seq_len
        return chunk[:-1].view(rows, seq_len), chunk[1:].view(rows, seq_len)
