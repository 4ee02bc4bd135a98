"""The file I/O engine under the container format: how bytes move, not what they mean.

Private. :mod:`ckptkit.format._container` (the format rules) reads and writes through it:
positional reads and read-only mmap windows (:class:`Source`), write-behind with
Linux ``sync_file_range`` through ctypes (:class:`WriteBehind`), which also tells a
:class:`Followed` file's reader which bytes are final (an upload of its parts while it is
written, spec/objectstore.md R-O52), and a keyed thread
pool that reports the earliest failure in file order (:func:`run_keyed`) over a plain
thread pool (:func:`run_parallel`; not torch's: its parallel ``copy_`` spins its OpenMP pool
per tensor and is many times slower on a busy machine, ``bench/``). None of it
knows the layout of a checkpoint; ``spec/performance.md`` says why each knob has its value.
"""

from __future__ import annotations

import errno
import io
import mmap
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, TypeVar

from ..errors import CheckpointNotFound, TruncatedFile, UnreadableFile

__all__ = [
    "ZEROS",
    "Followed",
    "Progress",
    "Source",
    "open_regular",
    "WriteBehind",
    "cpus",
    "file_kind",
    "run_keyed",
    "run_parallel",
    "write_all",
    "write_zeros",
]

T = TypeVar("T")

# Performance knobs (none of them is format; spec/performance.md says why each value).
_WINDOW = 32 << 20  # Source.feed maps at most this much of the file at a time (per thread): bounded resident memory
_MAP_MIN = 1 << 20  # extents shorter than this are read with pread (a mapping costs syscalls)
_WRITE_BEHIND = 8 << 20  # start writeback of every 8 MiB written, so the final fsync waits for little


# ---------------------------------------------------------------------------- reading


class Source:
    """Positional reads from a file or bytes, raising TruncatedFile on a short read.

    ``kind`` names the file in "no such ... file" errors (a checkpoint or a sidecar).
    """

    def __init__(
        self, path: str | os.PathLike[str] | None = None, data: bytes | None = None, kind: str = "checkpoint"
    ) -> None:
        self.path = None if path is None else os.fspath(path)
        self._data = data
        self._fd = -1
        if data is None:
            assert self.path is not None
            self._fd, self.size = open_regular(self.path, kind)
        else:
            self.size = len(data)

    @property
    def fd(self) -> int:
        return self._fd

    def map_private(self) -> mmap.mmap | None:
        """The whole file mapped copy-on-write (writes stay in this process), or None where it cannot be.

        Nothing is read until touched; the kernel is asked to read ahead. Tensors
        handed out as views of the mapping keep it alive after the file is closed.
        Known limit: a file truncated in place by another program while mapped
        faults (SIGBUS) on access, and one rewritten in place may show the new bytes
        in pages not yet written to; ckptkit replaces files by rename, never in place.
        """
        if self._fd < 0 or not self.size or not _CAN_MAP:
            return None
        try:
            m = mmap.mmap(self._fd, 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError):  # a file system without mmap: the caller reads instead
            return None
        if hasattr(mmap, "MADV_WILLNEED"):
            m.madvise(mmap.MADV_WILLNEED)
        return m

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pread(self, offset: int, n: int, field: str) -> bytes:
        if offset + n > self.size:
            raise TruncatedFile(
                f"needs {n} bytes but the file ends at {self.size}",
                path=self.path,
                offset=offset,
                field=field,
                expected=offset + n,
                actual=self.size,
            )
        if self._data is not None:
            return self._data[offset : offset + n]
        out = os.pread(self._fd, n, offset)
        if len(out) != n:  # the file shrank under us
            raise TruncatedFile("file shrank while reading", path=self.path, offset=offset, field=field)
        return out

    def readinto(self, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` from ``offset`` (the caller has checked the bounds)."""
        if self._data is not None:
            buf[:] = self._data[offset : offset + buf.nbytes]
            return
        done = 0
        while done < buf.nbytes:
            got = os.preadv(self._fd, [buf[done:]], offset + done)
            if got <= 0:
                raise TruncatedFile("file shrank while reading", path=self.path, offset=offset + done)
            done += got

    def chunks(self, start: int, end: int, scratch: bytearray) -> Iterator[memoryview]:
        """Yield the bytes of ``[start, end)`` in chunks, reusing ``scratch``."""
        mv = memoryview(scratch)
        pos = start
        while pos < end:
            n = min(len(scratch), end - pos)
            self.readinto(pos, mv[:n])
            yield mv[:n]
            pos += n

    def feed(self, start: int, end: int, update: Callable[[memoryview], object], scratch: bytearray) -> None:
        """Pass the bytes of ``[start, end)`` to ``update`` in pieces (the caller has checked the bounds).

        A long extent of a file is hashed straight from the page cache through a
        read-only mapping of at most 32 MiB at a time (no copy; bounded resident
        memory); short extents, in-memory sources and systems without ``mmap``
        flags use positional reads into ``scratch``. Known limit: a file truncated
        by another process *while* it is mapped faults (SIGBUS); ckptkit itself
        never truncates a checkpoint in place (spec/guarantees.md).
        """
        if self._fd < 0 or end - start < _MAP_MIN or not _CAN_MAP:
            for chunk in self.chunks(start, end, scratch):
                update(chunk)
            return
        pos = start
        while pos < end:
            base = pos - pos % mmap.ALLOCATIONGRANULARITY
            stop = min(end, base + _WINDOW)
            try:
                m = mmap.mmap(
                    self._fd, stop - base, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=mmap.PROT_READ, offset=base
                )
            except (OSError, ValueError):  # e.g. a file system without mmap: fall back to reads
                for chunk in self.chunks(pos, end, scratch):
                    update(chunk)
                return
            with m, memoryview(m) as whole, whole[pos - base :] as piece:
                update(piece)
            pos = stop


def open_regular(path: str, kind: str) -> tuple[int, int]:
    """Open ``path`` for reading if it is a regular file: ``(fd, size)``.

    Raises:
        CheckpointNotFound: nothing at ``path`` (a dangling symlink included).
        UnreadableFile: something is there but is no readable file: a directory,
            FIFO, device, socket, a symlink loop, no permission.
    """
    try:
        # O_NONBLOCK: opening a FIFO named like a checkpoint must not hang.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CheckpointNotFound(f"{path}: no such {kind} file") from None
    except IsADirectoryError:
        raise UnreadableFile(f"{path}: is a directory, not a {kind} file", errno=errno.EISDIR, path=path) from None
    except OSError as e:
        code = errno.errorcode.get(e.errno or 0, "error")
        raise UnreadableFile(
            f"{path}: cannot open the {kind} file ({code}: {e.strerror})", errno=e.errno, path=path
        ) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        what = file_kind(st.st_mode)
        a = "an" if kind[:1] in "aeiou" else "a"
        raise UnreadableFile(f"{path}: is {what}, not {a} {kind} file ({a} {kind} is a regular file)", path=path)
    os.set_blocking(fd, True)
    return fd, st.st_size


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """What a path that is not a regular file is, in words (``a directory``, ``a FIFO (named pipe)``)."""
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")


_CAN_MAP = hasattr(mmap, "MAP_SHARED") and hasattr(mmap, "PROT_READ")
# MAP_POPULATE reads the window in one go (readahead-sized requests, no per-page faults).
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def run_keyed(tasks: list[Callable[[], None]], keys: list[int], errors: dict[int, BaseException], threads: int) -> None:
    """Run every task (in ``threads`` threads), recording each failure under its key."""

    def one(k: int) -> None:
        try:
            tasks[k]()
        except Exception as e:  # noqa: BLE001 - recorded, re-raised by the caller in file order
            errors[keys[k]] = e  # distinct keys: no lock needed

    run_parallel(one, range(len(tasks)), threads, "ckptkit-read")


# ---------------------------------------------------------------------------- writing


def write_all(fd: int, buf: memoryview) -> None:
    while buf.nbytes:
        n = os.write(fd, buf)
        buf = buf[n:]


ZEROS = memoryview(bytes(4096))


def write_zeros(fd: int, n: int) -> None:
    while n:
        k = min(n, len(ZEROS))
        write_all(fd, ZEROS[:k])
        n -= k


class Progress(Protocol):
    """Who reads a file while its writer writes it (an upload of its parts, spec/objectstore.md R-O52):
    told which bytes are written and final, so that it never reads one the writer changes later."""

    def hold(self, start: int, end: int) -> None:
        """Bytes ``[start, end)`` will be rewritten before the write ends: not final until
        :meth:`release` says so. Said before :meth:`reached` passes them."""

    def release(self, start: int, end: int) -> None:
        """The held bytes ``[start, end)`` are rewritten: final now.

        Raises:
            CheckpointError: the reader failed (an upload); the writer stops with it.
        """

    def reached(self, pos: int) -> None:
        """Every byte before file offset ``pos`` is written, and final outside the held ranges.

        Raises:
            CheckpointError: the reader failed (an upload); the writer stops with it.
        """


class Followed(io.FileIO):
    """The unbuffered file ``fd`` (not closed with this object), whose writer reports its progress to
    ``progress`` through :class:`WriteBehind`; a writer that does not report leaves every byte to the
    end of the write, as for a plain file."""

    def __init__(self, fd: int, progress: Progress) -> None:
        super().__init__(fd, "r+b", closefd=False)
        self.progress = progress


class WriteBehind:
    """Starts writeback of each 8 MiB as soon as it is written (Linux ``sync_file_range``), and tells a
    :class:`Followed` file's reader what is written.

    Without it, a save copies everything into the page cache and only then does
    the final fsync start the disk: the two phases add up. With it the disk
    writes while the rest is still being copied, and the fsync (still done, by
    :func:`ckptkit.format._atomic.atomic_write`) waits only for the tail. It is a hint:
    durability comes from the fsync, and where the call is missing or fails
    (other systems, some file systems) nothing changes but speed.
    """

    def __init__(self, f: Any) -> None:
        self.fd, self.done = f.fileno(), 0
        self.progress: Progress | None = f.progress if isinstance(f, Followed) else None

    def hold(self, start: int, end: int) -> None:
        """Bytes ``[start, end)``, written now, are rewritten before the write ends (see :class:`Progress`)."""
        if self.progress is not None:
            self.progress.hold(start, end)

    def release(self, start: int, end: int) -> None:
        """The held bytes ``[start, end)`` are final now (see :class:`Progress`).

        Raises:
            CheckpointError: a :class:`Followed` file's reader failed.
        """
        if self.progress is not None:
            self.progress.release(start, end)

    def reached(self, pos: int) -> None:
        """Everything before file offset ``pos`` has been written (and is final outside the held ranges).

        Raises:
            CheckpointError: a :class:`Followed` file's reader failed.
        """
        if self.progress is not None:
            self.progress.reached(pos)
        if pos - self.done >= _WRITE_BEHIND:
            _start_writeback(self.fd, self.done, pos - self.done)
            self.done = pos


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = None  # resolved on first use: a callable, or False where unavailable


def _start_writeback(fd: int, offset: int, n: int) -> None:
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _sync_file_range = fn
        except (OSError, AttributeError):  # not Linux/glibc: no write-behind, same bytes
            pass
    if _sync_file_range:
        _sync_file_range(fd, offset, n, _SYNC_FILE_RANGE_WRITE)  # a hint: a failure only costs speed


# ---------------------------------------------------------------------------- threads


def cpus() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def run_parallel(fn: Callable[[T], None], items: Iterable[T], lanes: int, name: str) -> None:
    """Call ``fn(item)`` for every item, in ``lanes`` threads (the caller's included).

    Items are handed out in order; ``fn`` must not raise (record failures itself).
    """
    lock = threading.Lock()
    it = iter(items)

    def worker() -> None:
        while True:
            with lock:
                item = next(it, _DONE)
            if item is _DONE:
                return
            fn(item)  # type: ignore[arg-type]

    pool = [threading.Thread(target=worker, name=f"{name}-{n}", daemon=True) for n in range(max(lanes, 1) - 1)]
    for t in pool:
        t.start()
    worker()
    for t in pool:
        t.join()


_DONE = object()
