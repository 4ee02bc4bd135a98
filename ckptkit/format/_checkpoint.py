"""Public entry points: :class:`Checkpoint`, :func:`save`, :func:`load`.

A :class:`Checkpoint` is the whole of what a container carries: the training step,
four state trees (model, optimizer, EMA teacher, monitor/run state) and the flag
bits. :func:`save` writes it atomically as a v2 container; :func:`load` reads v2
and legacy v1, verifying every digest in the same pass that reads the bytes.

torch is imported lazily (inside the functions), so ``import ckptkit`` stays cheap
for the torch-free tools (``ckptkit verify``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

from ..errors import InsufficientMemory, UnsupportedValue
from ._checks import check_u64, is_int
from ._container import (
    FLAG_FP32_FALLBACK,
    FLAG_NAMES,
    HEADER_SIZE,
    SECTIONS,
    VERSION,
    Source,
    check_flags,
    check_skeleton,
    read_layout,
    write_container,
)

if TYPE_CHECKING:
    import torch

__all__ = ["Checkpoint", "container_writer", "import_torch_checkpoint", "load", "save"]


@dataclass(frozen=True)
class Checkpoint:
    """Everything one checkpoint carries.

    Attributes:
        step: the training step the state belongs to (the number of steps taken).
        model: the model state tree, usually ``{name: module.state_dict()}``; None if absent.
        optim: optimizer-side state (optimizers, schedulers, scalers); None if absent.
        teacher: the EMA teacher's state tree, as the run left it; None if absent.
        monitor: training-monitor and run-progress state; None if absent.
        flags: the flag bits (bit 0 = :data:`~ckptkit.format.FLAG_FP32_FALLBACK`).
        legacy: loaded from a v1 container.
        missing: what the file's format could not carry (for v1: teacher, flags,
            monitor, integrity). Nothing is invented for them; the caller decides.
        version: the container version the file was read from.
    """

    step: int
    model: Any = None
    optim: Any = None
    teacher: Any = None
    monitor: Any = None
    flags: int = 0
    legacy: bool = False
    missing: tuple[str, ...] = ()
    version: int = VERSION

    def __post_init__(self) -> None:
        check_u64("step", self.step)
        if not is_int(self.flags):
            raise ValueError(f"flags must be a non-negative integer (got {self.flags!r})")
        unknown = self.flags & ~sum(1 << b for b in FLAG_NAMES)
        if unknown:
            raise ValueError(f"flags has bits this version cannot store: 0x{unknown:x}")

    @property
    def fp32_fallback(self) -> bool:
        """The one-way fp32-factor fallback latch (flags bit 0)."""
        return bool(self.flags & FLAG_FP32_FALLBACK)

    @property
    def absent(self) -> tuple[str, ...]:
        """Names of the sections this checkpoint does not carry (zero-length on disk)."""
        return tuple(name for name in SECTIONS if getattr(self, name) is None)


def save(
    path: str | os.PathLike[str],
    ckpt: Checkpoint,
    *,
    compression: str | Mapping[str, str] = "raw",
    level: int = 3,
) -> None:
    """Write ``ckpt`` to ``path`` as a v2 container, atomically and durably.

    The file appears whole or not at all (temp file, fsync, rename, fsync dir); when
    ``save`` returns it survives power loss. Same checkpoint, same bytes.

    Args:
        path: destination file; its directory must exist. Or an ``s3://bucket/key`` URL
            (the ``ckptkit[s3]`` extra): the same bytes as one object, committed by its
            record ``key.commit.json``, written once (spec/objectstore.md).
        ckpt: the state to store. Tensors may live on any device and need not be
            contiguous; they are written as contiguous little-endian bytes.
        compression: ``"raw"`` (default) or ``"zstd"`` for every section, or a
            mapping ``{section: codec}``. zstd rarely pays on float weights
            (see ``bench/``); it is there for optimizer state and small integers.
        level: zstd level when compressing.

    Raises:
        UnsupportedValue: a value in a tree that the container cannot carry,
            named by its path (nothing is written).
        SaveFailed: the write failed (disk full, I/O error, permission); the
            previous file at ``path`` is untouched and no temporary file remains.
        CommitConflict: ``path`` is a URL where a checkpoint is committed already.
        UnsupportedOption: a URL of a scheme other than ``s3://``, or the S3 client missing.

    Example:
        >>> save("run/step-00000100.ckpt", Checkpoint(step=100, model={"net": net.state_dict()}))  # doctest: +SKIP
    """
    from ._place import write_file

    # at a URL, the same bytes committed by its record (spec/objectstore.md)
    write_file(path, container_writer(ckpt, compression=compression, level=level))


def container_writer(
    ckpt: Checkpoint, *, compression: str | Mapping[str, str] = "raw", level: int = 3
) -> Callable[[BinaryIO], None]:
    """``write(f)``, which writes ``ckpt`` as a v2 container into ``f`` (an unbuffered binary file at
    position 0), its trees planned now: what :func:`save` writes, for a writer that owns the file
    (a run's place, spec/objectstore.md R-O52). It holds the tensors until it is dropped.

    Raises:
        UnsupportedValue: a value the container cannot carry, named by its path (nothing is written).
    """
    if not isinstance(ckpt, Checkpoint):
        raise UnsupportedValue(f"save() takes a Checkpoint (got {type(ckpt).__name__})")
    from ._codec import plan_trees

    trees = {name: getattr(ckpt, name) for name in SECTIONS}
    plans, keep = plan_trees(trees, start=HEADER_SIZE, compression=compression, level=level)

    return functools.partial(_write_planned, ckpt.step, ckpt.flags, dict(zip(SECTIONS, plans, strict=True)), keep)


def _write_planned(step: int, flags: int, plans: dict[str, Any], keep: object, f: BinaryIO) -> None:
    """:func:`container_writer`'s writer; ``keep``, the tensors backing the planned bytes, lives as long as it."""
    write_container(f, step=step, flags=flags, plans=plans)


def load(
    path: str | os.PathLike[str],
    *,
    map_location: str | torch.device = "cpu",
    into: Mapping[str, Any] | None = None,
    strict: bool = True,
    max_memory: int | None = None,
) -> Checkpoint:
    """Read a v2 or legacy v1 container, verifying every byte it returns.

    Without ``into``, tensors of a raw section are views of a private
    (copy-on-write) mapping of the file, each hashed where it lies before the
    call returns, in one thread per core: nothing is copied, and writing into a
    tensor never changes the file. With ``into``, each stored tensor is read
    straight into your own tensor (parameter, buffer, optimizer state) and hashed
    in the same pass — no second copy, no ``load_state_dict`` copy afterwards.
    Tensors of a zstd section are decoded into new memory.

    Args:
        path: the checkpoint file, or an ``s3://`` URL (its object's size and xxh3-64
            checked against its commit record before a byte is parsed).
        map_location: device for the loaded tensors (those without a destination).
        into: ``{section: destination tree}``, e.g.
            ``{"model": {"net": net.state_dict()}, "optim": {"optimizers": {"adamw": opt.state_dict()}}}``.
            Each tensor in a destination tree receives the stored tensor at the
            same key path; dtype and shape must match exactly. The returned
            trees hold those destination tensors. Non-CPU or non-contiguous
            destinations are filled through a temporary.
        strict: with ``into``, refuse stored tensors the destination tree has
            no tensor for (as ``load_state_dict(strict=True)`` does); with
            ``strict=False`` they are loaded into new memory (e.g. an optimizer
            whose state is still empty).
        max_memory: the most bytes of new tensor memory the load may allocate.
            None (default): the memory this process has available (the least of
            ``MemAvailable``, the cgroup limit and ``RLIMIT_AS`` headroom; no
            check where none is known). Checked against the sizes the file
            declares before anything is allocated: a zstd section can declare up
            to 32768 x its stored size. Pass a number to cap a service that loads
            untrusted files, or a large one to skip the check.

    Returns:
        The :class:`Checkpoint`. A v1 file loads with ``legacy=True`` and
        ``missing`` naming what v1 cannot carry; absent sections are ``None``.

    Raises:
        CheckpointNotFound: no such file. ``IncompleteCheckpoint`` at a URL: objects
            without their commit record (an interrupted save), named.
        BadMagic, UnsupportedVersion, TruncatedFile, MalformedIndex,
        ChecksumMismatch, ReservedBitSet: the bytes break a rule of
            ``spec/container.md``; the message names the file, offset and section.
            With ``into``, destinations read before a ``ChecksumMismatch`` was
            found hold the file's (unverified) bytes: restore again from a good
            checkpoint before using them.
        StateMismatch: ``into`` does not fit the file (a key the file lacks, a
            shape or dtype that differs, with ``strict`` a stored tensor without
            destination); every problem is listed and nothing has been written.
        InsufficientMemory: the tensors to allocate exceed ``max_memory`` (or the
            memory available); raised before anything is allocated. Also raised,
            naming the file, when the process runs out of memory anyway (a file
            declaring millions of tensors: each loaded tensor is a Python object),
            never a bare ``MemoryError``.

    Example:
        >>> ckpt = load("run/step-00000100.ckpt")  # doctest: +SKIP
        >>> net.load_state_dict(ckpt.model["net"])  # doctest: +SKIP
        >>> load("run/step-00000100.ckpt", into={"model": {"net": net.state_dict()}})  # doctest: +SKIP
    """
    from ._place import read_file

    opened = read_file(path)
    try:
        return _load_source(opened, map_location=map_location, into=into, strict=strict, max_memory=max_memory)
    except (MemoryError, RuntimeError) as e:
        if isinstance(e, InsufficientMemory) or not _out_of_memory(e):
            raise
        raise InsufficientMemory(
            f"{opened.path or 'checkpoint'}: ran out of memory while loading it ({opened.size} bytes; the tensors' "
            "memory was checked before allocating, so its index and the tensor objects did not fit): nothing of the "
            "load is kept. Free memory or raise the limit (ulimit -v, the cgroup), or read only the tensors you "
            "need with ckptkit.open_checkpoint"
        ) from None


def _out_of_memory(e: BaseException) -> bool:
    """Python's MemoryError, or torch's for a C++ allocation that failed (a RuntimeError naming bad_alloc)."""
    return isinstance(e, MemoryError) or "bad_alloc" in str(e) or "can't allocate memory" in str(e)


def _load_source(
    opened: Source, *, map_location: Any, into: Mapping[str, Any] | None, strict: bool, max_memory: int | None
) -> Checkpoint:
    """:func:`load` of an opened source (closed when done)."""
    with opened as src:
        layout = read_layout(src)
        if not layout.legacy:
            check_skeleton(src, layout)
            check_flags(layout)
        from ._codec import load_sections

        trees = load_sections(
            src, layout.sections, map_location=map_location, into=into, strict=strict, max_memory=max_memory
        )
    return Checkpoint(
        step=layout.step,
        flags=layout.flags,
        legacy=layout.legacy,
        missing=layout.missing,
        version=layout.version,
        **trees,
    )


def import_torch_checkpoint(path: str | os.PathLike[str], *, map_location: str | torch.device = "cpu") -> Any:
    """Read an existing ``torch.save`` file once, safely, to move it into ckptkit.

    Uses ``torch.load(weights_only=True)``: torch's restricted unpickler, which
    builds only tensors and plain containers and refuses every other global, so no
    code in the file runs. The result is then checked against what a ckptkit
    container can carry.

    Args:
        path: a file written by ``torch.save``.
        map_location: device for the tensors.

    Returns:
        The object that was saved (typically a dict of state dicts), ready to be
        put in a :class:`Checkpoint`.

    Raises:
        CheckpointNotFound: no such file.
        UnsupportedValue: the file holds anything but tensors and plain containers
            (the unpickler refused it), or a value a container cannot carry.

    Example:
        >>> old = import_torch_checkpoint("ckpt.pt")  # doctest: +SKIP
        >>> save("run/step-00001000.ckpt", Checkpoint(step=1000, model={"net": old["model"]},
        ...                                            optim={"adamw": old["optimizer"]}))
    """
    import pickle
    import warnings

    import torch

    from ..errors import CheckpointNotFound
    from ._codec import encode_tree

    path = os.fspath(path)
    try:
        with warnings.catch_warnings():  # torch warns about any pickle protocol but its own; not actionable
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            obj = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointNotFound(f"{path}: no such file") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise UnsupportedValue(
            f"{path}: torch.load(weights_only=True) refused it ({_refusal_reason(e)}); only tensors and plain "
            "containers are imported, never arbitrary pickle"
        ) from None
    encode_tree(obj, path)
    return obj


def _refusal_reason(e: BaseException) -> str:
    """The line of torch's refusal that says what the file holds, as plain text.

    torch's weights-only message opens with advice to load with ``weights_only=False``
    (which would run the file's code) in terminal bold; the line that names the
    refused object is ``WeightsUnpickler error: Unsupported global: ...``.
    """
    import re

    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", str(e))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    named = [line for line in lines if line.startswith("WeightsUnpickler error:")]
    reason = (named or lines or [type(e).__name__])[0]
    return reason.split(" Please use ", 1)[0].removeprefix("WeightsUnpickler error: ")
