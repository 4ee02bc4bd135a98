"""Sidecars: state kept next to a checkpoint, stamped with the training step.

A sidecar (``<checkpoint>.<kind>``, e.g. ``step-00000120.ckpt.ngram``) holds state
that lives outside the container — the reference trainer's n-gram table, updated
outside autograd. Design record item 7: a sidecar without a training-step stamp
lets a crash between two writes pair ``model@S`` with ``tables@S-k`` silently. So
the header carries both the table's own step and **the training step it belongs
to**, and a reader refuses a sidecar whose training step is not the checkpoint's.

Layout (``spec/sidecar.md``): a 32-byte header, one section (the same section
encoding as the container), and the container's 16-byte trailer shape::

    ["DMSC\\0\\1\\0\\0"][train_step u64][table_step u64][table_len u64][table][digest u64]["DMSCEND\\0"]

The reading half below is torch-free; :func:`write_sidecar` and :func:`read_sidecar`
import the tensor codec when called.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError, SidecarMismatch
from ._atomic import atomic_write
from ._checks import check_u64
from ._container import Layout, Source, check_magic, check_skeleton, read_framed, write_framed
from ._read import check_tensors
from ._verify import Report, section_infos

__all__ = [
    "SIDECAR_VERSION",
    "Sidecar",
    "read_sidecar",
    "sidecar_digest",
    "sidecar_path",
    "sidecar_report",
    "verify_sidecar",
    "write_sidecar",
]

SIDECAR_VERSION = 1
_MAGIC = b"DMSC\x00" + struct.pack("<H", SIDECAR_VERSION) + b"\x00"
_END = b"DMSCEND\x00"
_HEADER = struct.Struct("<8sQQQ")  # magic, train_step, table_step, table_len


@dataclass(frozen=True)
class Sidecar:
    """A loaded sidecar: its stamps and its state tree."""

    train_step: int  # the training step of the checkpoint it belongs to
    table_step: int  # the table's own update counter (its optimizer steps, rows seen...)
    tree: Any
    # The stored skeleton digest: with the checks a read makes, it stands for every byte,
    # so a checkpoint binds its sidecar by recording it (spec/companions.md R-C04).
    digest: int = 0


def sidecar_path(checkpoint: str | os.PathLike[str], kind: str) -> str:
    """``<checkpoint>.<kind>``: where the ``kind`` sidecar of a checkpoint lives."""
    if not kind.isidentifier():
        raise ValueError(f"sidecar kind must be an identifier such as 'ngram' (got {kind!r})")
    return f"{os.fspath(checkpoint)}.{kind}"


def write_sidecar(path: str | os.PathLike[str], *, train_step: int, table_step: int, tree: Any) -> int:
    """Write a sidecar atomically (temp file, fsync, rename, fsync dir).

    Returns:
        Its skeleton digest, which the checkpoint records to bind it (R-C04).

    Raises:
        UnsupportedValue: a value in ``tree`` the codec cannot carry.
        SaveFailed: the write failed; the previous file is intact.
    """
    from ._codec import plan_trees

    check_u64("train_step", train_step)
    check_u64("table_step", table_step)
    if tree is None:
        raise ValueError("a sidecar needs a state tree (got None)")
    (plan,), keep = plan_trees({"table": tree}, start=_HEADER.size)
    assert plan is not None  # a non-None tree always gets a plan
    header = _HEADER.pack(_MAGIC, train_step, table_step, plan.length)
    atomic_write(path, lambda f: write_framed(f, header, [plan], _END))
    del keep
    return sidecar_digest(path)


def _layout(src: Source) -> tuple[Layout, int]:
    check_magic(src, _MAGIC, "sidecar", "R-020")
    _, train_step, table_step, n = _HEADER.unpack(src.pread(0, _HEADER.size, "sidecar header"))
    sections, trailer_at, digest = read_framed(src, _HEADER.size, {"table": n}, {"table": 24}, _END)
    layout = Layout(
        src.path, SIDECAR_VERSION, train_step, 0, sections, False, (), src.size, trailer_at, digest, _HEADER.size
    )
    return layout, table_step


def _check_stamp(path: str | None, train_step: int, expect_step: int | None) -> None:
    if expect_step is not None and train_step != expect_step:
        raise SidecarMismatch(
            f"sidecar belongs to training step {train_step}, its checkpoint is at step {expect_step}",
            path=path,
            offset=8,
            field="train_step",
            expected=expect_step,
            actual=train_step,
            hint="a crash between the checkpoint and sidecar writes; resume from an earlier checkpoint (R-021)",
        )


def verify_sidecar(path: str | os.PathLike[str], *, expect_step: int | None = None) -> int:
    """Check every byte of a sidecar and, if given, its training-step stamp.

    Returns:
        The sidecar's training step.

    Raises:
        CheckpointNotFound: no such file.
        FormatError: corrupt, truncated, of an unknown version, or (with
            ``expect_step``) :class:`SidecarMismatch`.
    """
    with Source(path, kind="sidecar") as src:
        layout, _ = _layout(src)
        _check_stamp(src.path, layout.step, expect_step)
        check_skeleton(src, layout)
        sec = layout.sections["table"]
        if sec is not None:
            check_tensors(src, sec, bytearray(1 << 20))
    return layout.step


def sidecar_digest(path: str | os.PathLike[str]) -> int:
    """A sidecar's stored skeleton digest, its structure checked but no byte hashed:
    what a checkpoint's companion record is compared with (R-C04).

    Raises:
        CheckpointNotFound: no such file.
        FormatError: not a sidecar, of an unknown version, or malformed.
    """
    with Source(path, kind="sidecar") as src:
        layout, _ = _layout(src)
    assert layout.skeleton_digest is not None  # a sidecar always has a trailer
    return layout.skeleton_digest


def sidecar_report(path: str | os.PathLike[str]) -> Report:
    """:func:`verify_sidecar` as a :class:`~ckptkit.format.Report` (for ``ckptkit verify``).

    Raises:
        CheckpointNotFound: no such file.
    """
    path = os.fspath(path)
    try:
        verify_sidecar(path)
        with Source(path, kind="sidecar") as src:
            layout, _ = _layout(src)
    except FormatError as e:
        return Report(path, False, e, None, None, (), False, (), (), os.path.getsize(path), 0, "sidecar")
    return Report(
        path, True, None, layout.version, layout.step, (), False, (), section_infos(layout), layout.size, 0, "sidecar"
    )


def read_sidecar(path: str | os.PathLike[str], *, expect_step: int | None = None) -> Sidecar:
    """Load a sidecar, verifying every byte; refuse one stamped with another step.

    Args:
        path: the sidecar file (see :func:`sidecar_path`).
        expect_step: the training step of the checkpoint it must belong to.

    Raises:
        SidecarMismatch: the stamp names another training step (message names both).
        CheckpointNotFound, FormatError: missing, corrupt or truncated file.
    """
    from ._codec import load_section

    with Source(path, kind="sidecar") as src:
        layout, table_step = _layout(src)
        _check_stamp(src.path, layout.step, expect_step)
        check_skeleton(src, layout)
        tree = load_section(src, layout.sections["table"])
    assert layout.skeleton_digest is not None  # checked by check_skeleton above
    return Sidecar(layout.step, table_step, tree, layout.skeleton_digest)
