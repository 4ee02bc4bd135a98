"""Private: ``ckptkit verify`` of a container: every byte checked, a :class:`Report`, never a
raise for bad bytes (spec/container.md, spec/validation.md).

The layout and the skeleton are :mod:`~ckptkit.format._container`'s checks, the tensors
:mod:`~ckptkit.format._read`'s; this module runs them in order and turns what they find
into the report ``ckptkit verify`` and ``ckptkit inspect`` print.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import CheckpointError, FormatError, IncompleteCheckpoint, InsufficientMemory, UnreadableFile
from ._container import _CHUNK, _V1_SECTIONS, Layout, check_flags, check_skeleton, read_layout
from ._io import Source
from ._read import check_all_tensors

__all__ = ["Report", "SectionInfo", "layout_report", "section_infos", "verify", "verify_source"]


@dataclass(frozen=True)
class SectionInfo:
    """One section as ``ckptkit inspect`` shows it."""

    name: str
    offset: int
    length: int  # bytes on disk, including the index
    codec: str | None  # None when absent
    tensors: int
    raw_len: int  # tensor-region bytes once decoded

    @property
    def present(self) -> bool:
        return self.length > 0


@dataclass(frozen=True)
class Report:
    """The verdict of :func:`verify` on one file. ``ok`` is False iff ``error`` is set."""

    path: str
    ok: bool
    error: CheckpointError | None
    version: int | None
    step: int | None
    flags: tuple[str, ...]
    legacy: bool
    missing: tuple[str, ...]
    sections: tuple[SectionInfo, ...]
    size: int
    bytes_hashed: int
    kind: str = "container"  # or "sidecar"


def section_infos(layout: Layout) -> tuple[SectionInfo, ...]:
    """Per-section summary for reports (absent sections included, length 0)."""
    out, pos = [], layout.header_size
    names = _V1_SECTIONS if layout.legacy else tuple(layout.sections)
    for name in names:
        sec = layout.sections[name]
        if sec is None:
            out.append(SectionInfo(name, pos, 0, None, 0, 0))
        else:
            out.append(SectionInfo(name, sec.start, sec.length, sec.codec, len(sec.tensors), sec.raw_len))
            pos = sec.start + sec.length
    return tuple(out)


def verify(path: str | os.PathLike[str]) -> Report:
    """Check every byte of a checkpoint file with bounded memory; never raises for bad bytes.

    Args:
        path: a checkpoint file, or an ``s3://`` URL: an object that lacks its commit
            record, or whose size or xxh3-64 differs from it, is a failed report.

    Returns:
        A :class:`Report`; ``report.ok`` is False and ``report.error`` holds the typed
        error when the file is corrupt, truncated, of an unknown version, or has a
        reserved flag set, or when the path is no readable file (a directory, FIFO,
        device, symlink loop: :class:`~ckptkit.errors.UnreadableFile`, ``size`` 0).
        A legacy v1 file that parses is ``ok`` (it has no digests to check;
        ``missing`` says so).

    Raises:
        CheckpointNotFound: nothing exists at ``path``.

    Example:
        >>> report = verify("run/step-00000100.ckpt")  # doctest: +SKIP
        >>> report.ok, report.step
        (True, 100)
    """
    path = os.fspath(path)
    from ._place import read_file

    try:
        opened = read_file(path)
    except (UnreadableFile, IncompleteCheckpoint, FormatError) as e:
        return layout_report(path, 0, None, e, 0)
    with opened as src:
        return verify_source(path, src)


def verify_source(path: str, src: Source) -> Report:
    """:func:`verify` of an open source (a file, or an object's bytes already checked against its
    commit record), named ``path`` in the report."""
    layout: Layout | None = None
    hashed = 0
    try:
        layout = read_layout(src)
        if not layout.legacy:
            scratch = bytearray(_CHUNK * 4)
            check_skeleton(src, layout, scratch)
            check_flags(layout)
            hashed, error = check_all_tensors(src, layout)
            if error is not None:
                raise error
    except FormatError as e:
        return layout_report(path, src.size, layout, e, hashed)
    except MemoryError:  # no verdict on the bytes: say so, never as damage and never as a bare MemoryError
        oom = InsufficientMemory(
            f"{path}: ran out of memory while verifying it ({src.size} bytes); the file is neither damaged nor "
            "sound by this run: free memory or raise the limit (ulimit -v, the cgroup) and verify again"
        )
        return layout_report(path, src.size, layout, oom, hashed)
    return layout_report(path, src.size, layout, None, hashed)


def layout_report(path: str, size: int, layout: Layout | None, error: CheckpointError | None, hashed: int) -> Report:
    """The :class:`Report` on a file whose layout was read (``layout`` None: not even that);
    :func:`verify` and ``ckptkit inspect`` both build theirs here, so the two list the same sections."""
    if layout is None:
        return Report(path, False, error, None, None, (), False, (), (), size, hashed)
    return Report(
        path,
        error is None,
        error,
        layout.version,
        layout.step,
        layout.flag_names,
        layout.legacy,
        layout.missing,
        section_infos(layout),
        size,
        hashed,
    )
