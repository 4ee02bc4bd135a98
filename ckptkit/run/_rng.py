"""Randomness as a pure function of (seed, step): counter-based splitmix64 streams.

Concept: every random number a training step uses is ``draw(seed, step, index,
stream)`` -- a value computed from its arguments alone. There is no generator
state to carry across a resume, no global RNG, and nothing depends on how many
draws happened before. A resumed run at step ``s`` draws exactly what the
uninterrupted run drew at step ``s``.

Invariants (spec/determinism.md, rules R-D01..R-D08):

- ``draw`` is a pure function: same arguments, same ``u64``, in any call order,
  in any process, in any language that follows the spec (test vectors there).
- For fixed ``(seed, step, stream)`` the draws over ``index`` are distinct
  (the last mixing step is a bijection of a Weyl sequence with an odd gamma).
- The vectorised forms (``draws``, ``uniforms``) equal the scalar forms exactly.
- No function here reads or advances ``random``, ``numpy.random`` or torch's
  global generator; ``import ckptkit.run._rng`` does not import torch.

Example::

    from ckptkit.run._rng import Stream, mask_stream, uniform
    u = uniform(seed=1, step=120, index=3, stream=Stream.DROPOUT)
    mask = mask_stream(256, 0.15, 10, seed=1, step=120)
"""

from __future__ import annotations

import contextlib
import enum
import operator
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..format._checks import as_int

if TYPE_CHECKING:  # pragma: no cover - typing only; torch is imported lazily
    import torch

__all__ = [
    "GAMMA",
    "Stream",
    "draw",
    "draws",
    "global_rng_state",
    "global_rngs_kept",
    "mask_stream",
    "mix64",
    "numpy_generator",
    "randint",
    "sample_depth",
    "set_global_rng_state",
    "step_rng",
    "torch_generator",
    "uniform",
    "uniforms",
]

_MASK64 = (1 << 64) - 1
# splitmix64 constants (Steele, Lea, Flood 2014; Vigna's reference C code).
# GAMMA is the odd Weyl increment (2**64 / golden ratio); M1/M2 are the Stafford
# "Mix13" multipliers; the shifts 30/27/31 go with them.
GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_TWO_POW_MINUS_53 = 2.0**-53  # uniform = top 53 bits * 2**-53, exact in binary64

_NP_GAMMA = np.uint64(GAMMA)
_NP_M1 = np.uint64(_M1)
_NP_M2 = np.uint64(_M2)
_NP_30 = np.uint64(30)
_NP_27 = np.uint64(27)
_NP_31 = np.uint64(31)
_NP_11 = np.uint64(11)


class Stream(enum.IntEnum):
    """Named stream ids, so that two uses of randomness in a step never share draws.

    The numbers are part of spec/determinism.md: renumbering changes every run.
    Add new members at the end; never reuse a retired number.
    """

    DEFAULT = 0  # ad-hoc draws; prefer a named stream
    INIT = 1  # parameter initialisation (step is 0)
    DATA = 2  # data order / sampling of training examples
    MASK = 3  # JEPA / span masks (mask_stream)
    DEPTH = 4  # rand-depth: the loop depth of a step (sample_depth)
    DROPOUT = 5  # dropout masks (via torch_generator)
    SAMPLE = 6  # text sampling at eval / generation time
    SPIKE = 7  # synthetic spike injection in tests


def mix64(z: int) -> int:
    """The splitmix64 finaliser: a bijection of ``[0, 2**64)``.

    Args:
        z: an integer; only its low 64 bits are used.

    Returns:
        ``z ^= z >> 30; z *= M1; z ^= z >> 27; z *= M2; z ^= z >> 31``, all mod 2**64.
    """
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def _absorb(h: int, x: int) -> int:
    # One splitmix64 output from state (h ^ x): mix64((h ^ x) + GAMMA).
    return mix64(((h ^ x) + GAMMA) & _MASK64)


def _key(seed: int, step: int, stream: int) -> int:
    """The per-(seed, stream, step) key: the state of the index counter (R-D02)."""
    return _absorb(_absorb(_absorb(0, seed), stream), step)


def draw(seed: int, step: int, index: int, stream: int = 0) -> int:
    """One 64-bit value, a pure function of (seed, step, index, stream).

    ``key = absorb(absorb(absorb(0, seed), stream), step)`` with
    ``absorb(h, x) = mix64((h ^ x) + GAMMA)``; the value is
    ``mix64(key + (index + 1) * GAMMA)``, i.e. output ``index`` of a splitmix64
    generator whose state is ``key`` (all arithmetic mod 2**64; spec/determinism.md R-D02).

    Args:
        seed: the run seed, an int in [0, 2**64).
        step: the training step, an int in [0, 2**64).
        index: which value of this step's stream, an int in [0, 2**64).
        stream: which use of randomness (see :class:`Stream`), an int in [0, 2**64).

    Returns:
        An int in [0, 2**64).

    Raises:
        TypeError: an argument is not an int (bool is refused too).
        ValueError: an argument is outside [0, 2**64).

    Example::

        >>> draw(0, 0, 0) == draw(0, 0, 0)
        True
    """
    key = _key(as_int("seed", seed, u64=True), as_int("step", step, u64=True), as_int("stream", stream, u64=True))
    return mix64(key + (as_int("index", index, u64=True) + 1) * GAMMA)


def uniform(seed: int, step: int, index: int, stream: int = 0) -> float:
    """A float in [0, 1): the top 53 bits of :func:`draw` times 2**-53 (exact).

    Args / Raises: as :func:`draw`.

    Returns:
        ``(draw(...) >> 11) * 2**-53``; every value is a multiple of 2**-53.
    """
    return (draw(seed, step, index, stream) >> 11) * _TWO_POW_MINUS_53


def _mix64_np(z: np.ndarray) -> np.ndarray:
    # uint64 arithmetic wraps mod 2**64 by design; errstate keeps numpy quiet
    # about it (pytest runs with warnings as errors, and the wrap is the point).
    with np.errstate(over="ignore"):
        z = (z ^ (z >> _NP_30)) * _NP_M1
        z = (z ^ (z >> _NP_27)) * _NP_M2
        mixed: np.ndarray = z ^ (z >> _NP_31)
        return mixed


def draws(seed: int, step: int, n: int, stream: int = 0) -> np.ndarray:
    """``draw(seed, step, i, stream)`` for ``i = 0 .. n-1``, vectorised.

    Args:
        seed, step, stream: as :func:`draw`.
        n: how many values, an int >= 0.

    Returns:
        A ``uint64`` array of length ``n``, equal element-wise to :func:`draw`.

    Raises:
        TypeError / ValueError: as :func:`draw`; ``n`` must be >= 0.

    Example::

        >>> int(draws(1, 2, 3)[2]) == draw(1, 2, 2)
        True
    """
    n = as_int("n", n)
    key = _key(as_int("seed", seed, u64=True), as_int("step", step, u64=True), as_int("stream", stream, u64=True))
    # (index + 1) * GAMMA + key, wrapping: the Weyl sequence of splitmix64.
    with np.errstate(over="ignore"):
        counters = np.arange(1, n + 1, dtype=np.uint64) * _NP_GAMMA + np.uint64(key)
    return _mix64_np(counters)


def uniforms(seed: int, step: int, n: int, stream: int = 0) -> np.ndarray:
    """``uniform(seed, step, i, stream)`` for ``i = 0 .. n-1``, vectorised.

    Args / Raises: as :func:`draws`.

    Returns:
        A ``float64`` array of length ``n`` in [0, 1), equal element-wise to :func:`uniform`.
    """
    # A uint64 below 2**53 converts to float64 exactly; the scaling is a power of two.
    out: np.ndarray = (draws(seed, step, n, stream) >> _NP_11).astype(np.float64) * _TWO_POW_MINUS_53
    return out


def randint(seed: int, step: int, lo: int, hi: int, *, index: int = 0, stream: int = 0) -> int:
    """An int in ``[lo, hi]`` (both inclusive) from one :func:`draw`.

    Uses the multiply-shift map ``lo + (draw * (hi - lo + 1)) >> 64`` (exact integer
    arithmetic, so every implementation agrees). Its bias is below
    ``(hi - lo + 1) / 2**64`` -- negligible for any range a trainer uses, and it
    needs exactly one draw (a rejection loop would consume a data-dependent number).

    Args:
        seed, step, index, stream: as :func:`draw`.
        lo, hi: the inclusive bounds, ``lo <= hi``.

    Returns:
        An int ``lo <= k <= hi``.

    Raises:
        ValueError: ``hi < lo``, or an argument of :func:`draw` is out of range.

    Example::

        >>> 3 <= randint(1, 7, 3, 6, stream=Stream.DEPTH) <= 6
        True
    """
    lo = operator.index(lo)
    hi = operator.index(hi)
    if hi < lo:
        raise ValueError(f"hi must be >= lo (got lo={lo}, hi={hi})")
    return lo + ((draw(seed, step, index, stream) * (hi - lo + 1)) >> 64)


def sample_depth(n_layers: int, min_depth: int, *, seed: int, step: int) -> int:
    """The rand-depth loop depth of a step: uniform in ``[min_depth, n_layers]``.

    ``randint(seed, step, min_depth, n_layers, index=0, stream=Stream.DEPTH)``.

    Args:
        n_layers: the model's depth, >= 1.
        min_depth: the smallest depth sampled, ``1 <= min_depth <= n_layers``.
        seed, step: as :func:`draw`.

    Returns:
        The depth to run at ``step``.

    Raises:
        ValueError: ``min_depth`` outside ``[1, n_layers]``.

    Example::

        >>> 2 <= sample_depth(6, 2, seed=1, step=10) <= 6
        True
    """
    if min_depth < 1:
        raise ValueError(f"min_depth must be >= 1 (got {min_depth})")
    if min_depth > n_layers:
        raise ValueError(f"min_depth must be <= n_layers (got min_depth={min_depth}, n_layers={n_layers})")
    return randint(seed, step, min_depth, n_layers, stream=Stream.DEPTH)


def mask_stream(
    t: int,
    mask_frac: float,
    mask_span: int,
    *,
    seed: int,
    step: int,
    stream: int = Stream.MASK,
    rows: int | None = None,
) -> np.ndarray:
    """A causal span mask of length ``t``, a pure function of (seed, step).

    Position ``j`` is a span start iff ``uniform(seed, step, j, stream) < p`` with
    ``p = mask_frac / mask_span`` (one IEEE division, so every implementation gets
    the same ``p``). Starts are dilated causally: position ``i`` is masked iff a
    start occurred in ``[i - mask_span + 1, i]``. Spans overlap, so the expected
    masked fraction away from the left edge is ``1 - (1 - p) ** mask_span``, a
    little below ``mask_frac`` (0.140 for 0.15 / 10); the first ``mask_span - 1``
    positions are masked less often. ``mask_frac = 0`` masks nothing; with
    ``mask_span = 1``, ``mask_frac = 1`` masks everything (spec/determinism.md R-D05).

    Args:
        t: sequence length, >= 0.
        mask_frac: span-start budget as a fraction of positions, in [0, 1].
        mask_span: span length in positions, >= 1.
        seed, step: as :func:`draw`.
        stream: the stream id, :attr:`Stream.MASK` unless a model draws two masks.
        rows: one mask per sequence of a batch: an ``(rows, t)`` array whose row
            ``r`` draws its starts at indices ``r * t + j`` and is dilated within
            the row (row 0 is the one-row mask). A batch sharing one mask would
            leave the whole step without a masked position whenever its one row
            has none.

    Returns:
        A ``bool`` array of length ``t`` (of shape ``(rows, t)`` with ``rows``).

    Raises:
        ValueError: an argument is out of range; the message names it.

    Example::

        >>> bool(mask_stream(8, 0.0, 2, seed=1, step=0).any())
        False
    """
    t = as_int("t", t)
    span = as_int("mask_span", mask_span, least=1)
    if isinstance(mask_frac, bool) or not isinstance(mask_frac, (int, float, np.integer, np.floating)):
        raise TypeError(f"mask_frac must be a number (got {type(mask_frac).__name__})")
    frac = float(mask_frac)
    if not 0.0 <= frac <= 1.0:  # also refuses NaN
        raise ValueError(f"mask_frac must be in [0, 1] (got {mask_frac})")
    n = 1 if rows is None else as_int("rows", rows)
    p = frac / span
    starts = (uniforms(seed, step, n * t, stream) < p).reshape(n, t)
    # masked[r, i] = any(starts[r, max(0, i - span + 1) : i + 1]) via a prefix count per row.
    counts = np.concatenate((np.zeros((n, 1), np.int64), np.cumsum(starts, axis=1, dtype=np.int64)), axis=1)
    hi = np.arange(1, t + 1)
    lo = np.maximum(hi - span, 0)
    mask = (counts[:, hi] - counts[:, lo]) > 0
    return mask[0] if rows is None else mask


def torch_generator(seed: int, step: int, stream: int = 0, device: Any = "cpu") -> torch.Generator:
    """A fresh ``torch.Generator`` seeded with ``draw(seed, step, 0, stream)``.

    For torch ops that need a generator (dropout, ``torch.randperm``): pass it
    explicitly, never rely on the global one. A new generator per (step, stream)
    makes its output a function of (seed, step) too. Use a stream either through
    this generator or through counter draws, not both (index 0 is the seed).

    Args:
        seed, step, stream: as :func:`draw`.
        device: the generator's device (``"cpu"``, ``"cuda"``, ...).

    Returns:
        A new generator; the global torch RNG is untouched.

    Raises:
        TypeError / ValueError: as :func:`draw`.

    Example::

        g = torch_generator(1, step, Stream.DROPOUT)
        keep = torch.rand(x.shape, generator=g) >= p
    """
    import torch  # lazy: the format core must not import torch

    value = draw(seed, step, 0, stream)
    g = torch.Generator(device=device)
    g.manual_seed(value)
    return g


def numpy_generator(seed: int, step: int, stream: int = 0) -> np.random.Generator:
    """A fresh ``numpy.random.Generator`` (PCG64) seeded with ``draw(seed, step, 0, stream)``.

    Args / Raises: as :func:`torch_generator`.

    Returns:
        A new generator; ``numpy.random``'s global state is untouched. Note that
        numpy keeps PCG64's bit stream stable across versions but not every
        distribution method, which is one reason the numpy version is an
        environment fact (ckptkit.run._environment).
    """
    return np.random.Generator(np.random.PCG64(draw(seed, step, 0, stream)))


@contextlib.contextmanager
def step_rng(seed: int, step: int, stream: int = Stream.DROPOUT) -> Iterator[None]:
    """Make the global-generator draws inside a block a function of ``(seed, step)``.

    For code that draws from torch's global generator and cannot be handed one:
    ``nn.Dropout``, ``torch.randn`` / ``torch.rand`` without ``generator=``,
    ``torch.randperm`` inside a library. Inside the block the global CPU generator
    (and every CUDA generator, when CUDA is initialised) is seeded with
    ``draw(seed, step, 0, stream)``; after it, they are exactly as before, so the
    rest of the program (and ``ckptkit.testing.assert_step_leaves_global_rng_alone``)
    sees no change. A resumed run then draws the same dropout masks as the run that
    never stopped.

    Example::

        with ckptkit.step_rng(cfg.seed, step):
            loss = loss_fn(model(x), y)      # model has nn.Dropout layers
        loss.backward()                      # dropout's backward reuses the saved mask
    """
    import torch

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = list(range(torch.cuda.device_count())) if cuda else []
    with torch.random.fork_rng(devices=devices):
        value = draw(seed, step, 0, stream)
        torch.default_generator.manual_seed(value)
        if cuda:
            torch.cuda.manual_seed_all(value)
        yield


def global_rng_state() -> dict[str, Any]:
    """The global generators' states: Python's ``random``, numpy's legacy global generator,
    torch's CPU generator and, when CUDA is initialised, every CUDA generator."""
    import random

    import torch

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=False),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


@contextlib.contextmanager
def global_rngs_kept() -> Iterator[None]:
    """After the block, every global generator (:func:`global_rng_state`) is as it was before.

    For work a run does on the side — the spike guard replaying steps to rebuild its
    ring — so that what it draws never reaches the steps that follow: a resumed run then
    draws exactly what it would have drawn without that work, and a step that depends on
    the global generator shows up as the divergence it is instead of being papered over.
    """
    before = global_rng_state()
    try:
        yield
    finally:
        set_global_rng_state(before)


def set_global_rng_state(state: dict[str, Any]) -> None:
    """Set every global generator to ``state`` (from :func:`global_rng_state`); its CUDA
    states only where CUDA is available."""
    import random

    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
