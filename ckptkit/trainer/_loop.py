"""The reference trainer: a tiny byte-level GPT whose resume is the same run.

    ckptkit train --run-dir runs/a --steps 200                 # fresh run
    ckptkit train --run-dir runs/a --steps 400 --resume        # extend it
    ckptkit train --run-dir runs/q --steps 100 --quant int8 --quant-check --rand-depth
    python -c "from ckptkit.trainer import TrainerConfig, train; train(TrainerConfig(), 'runs/b')"

It reads top to bottom like nanoGPT's ``train.py``: config, data, model,
optimizer, run state, start or resume, loop. Everything a checkpoint must
carry is registered with :class:`~ckptkit.run.RunState` in one place
(the "run state" section of :func:`train`), and that is the list the design
record (ADR-0021) asks for:

=====================  =====================================================
model, optimizer       ``add_model`` / ``add_optimizer`` (AdamW moments, step)
EMA teacher            ``add_teacher``: restored as the run left it (item 1)
fp32 fallback latch    ``add_flag("fp32_fallback")`` + ``after_restore`` (item 2)
mask, depth            nothing: functions of (seed, step) via ckptkit.run._rng (items 3, 5)
spike monitor          ``add_monitor``: the report survives a resume (item 4)
stream offset          ``add_data_position`` with the rule as ``expected`` (item 6)
bigram table           ``add_sidecar("ngram")``, stamped with the step (item 7)
the LR                 nothing: a function of the step and the config, times
                       the spike-rollback LR scale
spike rollback         the library's :class:`~ckptkit.SpikeGuard` (:func:`spike_guard`):
                       it registers its record with ``--auto-rollback on``
                       (LR scale, events, skipped batches; spec/rollback.md)
=====================  =====================================================

A step (:func:`train_step`) touches no global RNG: the batch comes from the
stream offset, the mask and the depth from ``(seed, step)``, and nothing else
is random. So a run interrupted at any checkpoint and resumed writes the same
checkpoint bytes and the same history rows as the run that never stopped;
``tests/trainer/test_trainer_resume.py`` proves it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ReplayDivergence, ResumeRefused, SidecarMismatch
from ..format._place import place_for
from ..guard._config import RollbackConfig
from ..guard._faults import GradSpike
from ..guard._monitor import SpikeMonitor, Verdict
from ..guard._rollback_record import skipped_batches
from ..guard._spikeguard import Executed, RolledBack, SpikeGuard
from ..run import RunState
from ..run._drift import DEFAULT_EXEMPT
from ..run._fingerprint import data_digest
from ..run._history import HISTORY_FILE, f32_bits, f64_bits, json_float
from ..run._preemption import RunStopped
from ..run._resume import resume_row
from ..run._rng import Stream, mask_stream, sample_depth, torch_generator
from ._config import RollbackSkip, TrainConfig, TrainerConfig
from ._data import ByteStream, data_fingerprint, load_bytes
from ._digests import checkpoint_row, param_digests, params_digest, perturb, perturb_target
from ._model import GPT, apply_compute_settings, make_teacher
from ._ngram import BigramTable
from ._parallel import Ranks, check_fits, full_tensor, ranks, wrap

__all__ = [
    "Run",
    "StepResult",
    "TrainResult",
    "build",
    "get_lr",
    "intra_op_threads",
    "observed_step",
    "pre_batches",
    "run_state",
    "spike_guard",
    "train",
    "train_step",
]

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(f"ckptkit train: {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the run's objects


@dataclass
class Run:
    """Everything a step reads or writes (what :func:`build` makes)."""

    cfg: TrainerConfig
    stream: ByteStream
    model: GPT
    teacher: GPT | None  # EMA teacher; None when --no-aux
    ngram: BigramTable | None  # None when --no-ngram
    optimizer: torch.optim.AdamW
    monitor: SpikeMonitor
    net: torch.nn.Module  # the student as the loop trains it: itself, or its DDP wrapper (R-T14)
    ranks: Ranks  # this process's rank and the world size (0 of 1 without torchrun)
    fp32_latched: bool = False  # the one-way fallback; never goes back to False in a run
    guard: SpikeGuard | None = None  # spike rollback (spec/rollback.md): set by spike_guard()

    @property
    def lr_scale(self) -> float:
        """Multiplies the scheduled LR: 1.0 until a spike rollback drops it (spec/rollback.md R-R06)."""
        return 1.0 if self.guard is None else self.guard.lr_scale

    @property
    def quant_active(self) -> bool:
        """True while the student's forward runs int8 factors."""
        return self.cfg.model.quant == "int8" and not self.fp32_latched

    def apply_compute_settings(self) -> None:
        """Make the forward match the config and the latch (after build, after every restore)."""
        apply_compute_settings(self.model, self.teacher, quant=self.cfg.model.quant, fp32_latched=self.fp32_latched)

    def latch_fp32(self) -> None:
        """Trip the one-way fallback: fp32 factors for the rest of the run."""
        self.fp32_latched = True
        self.apply_compute_settings()


@dataclass(frozen=True)
class StepResult:
    """What one step did; :meth:`row` is its line in ``history.jsonl``."""

    step: int
    loss: float  # the optimised total (float32 value)
    lm_loss: float  # next-byte cross-entropy, nats (float32 value)
    aux_loss: float | None  # masked-prediction MSE (float32 value); None when --no-aux
    grad_norm: float  # global L2 grad norm before clipping (float32 value)
    lr: float  # the learning rate used (float64)
    depth: int  # blocks the student ran
    compute: str  # "int8" or "fp32": the factor format the step trained
    latch: str | None  # why the fp32 fallback latched at this step, else None
    verdict: Verdict | None  # the spike monitor's judgement (None until the guard has observed the step)
    offset: int  # stream offset after the step (bytes)
    step_ms: float  # wall time of the step (not compared)
    # Per-parameter digests after the step (spec/replay.md R-P01), named as the checkpoint names them.
    param_digests: dict[str, int] | None = None
    rerun: bool = False  # the re-run of a spiking step from the state before it (spec/rollback.md R-R04)
    data: str | None = None  # digest of the bytes the step consumed (spec/determinism.md R-D26)

    def row(self) -> dict[str, Any]:
        assert self.verdict is not None, "a step row needs the monitor's verdict (observed_step / the guard)"
        aux = self.aux_loss
        return {
            "kind": "step",
            "step": self.step,
            "loss": json_float(self.loss),
            "loss_bits": f32_bits(self.loss),
            "lm_loss": json_float(self.lm_loss),
            "lm_loss_bits": f32_bits(self.lm_loss),
            "aux_loss": None if aux is None else json_float(aux),
            "aux_loss_bits": None if aux is None else f32_bits(aux),
            "grad_norm": json_float(self.grad_norm),
            "grad_norm_bits": f32_bits(self.grad_norm),
            "lr": self.lr,
            "lr_bits": f64_bits(self.lr),
            "depth": self.depth,
            "compute": self.compute,
            "latch": self.latch,
            "verdict": self.verdict.reason,
            "spike": self.verdict.is_spike,
            "offset": self.offset,
            "time": time.time(),
            "step_ms": self.step_ms,
            "params_digest": None if self.param_digests is None else params_digest(self.param_digests),
            "rerun": self.rerun,
            "data": self.data,
        }

    def line(self, steps: int) -> str:
        assert self.verdict is not None
        aux = "" if self.aux_loss is None else f" | aux {self.aux_loss:.4f}"
        spike = f" | SPIKE ({self.verdict.reason})" if self.verdict.is_spike else ""
        latch = f" | LATCHED fp32: {self.latch}" if self.latch else ""
        return (
            f"step {self.step + 1}/{steps} | loss {self.loss:.4f} | lm {self.lm_loss:.4f}{aux} | "
            f"gnorm {self.grad_norm:.3f} | lr {self.lr:.2e} | depth {self.depth} | {self.compute} | "
            f"{self.step_ms:.1f} ms{spike}{latch}"
        )


@dataclass(frozen=True)
class TrainResult:
    """What :func:`train` leaves behind."""

    step: int  # steps done
    checkpoint: str | None  # the newest checkpoint written by this call, or None
    history: str  # path of history.jsonl
    fp32_latched: bool
    report: dict[str, Any]  # the spike monitor's stability report
    resume_notes: tuple[str, ...] = ()
    rollback: dict[str, Any] | None = None  # the rollback record (--auto-rollback on; spec/rollback.md R-R08)


# ----------------------------------------------------------------------------- schedule and probes


def get_lr(step: int, tc: TrainConfig) -> float:
    """Linear warmup, then cosine decay to ``min_lr`` at ``lr_decay_iters`` (nanoGPT).

    A function of the step and the config only, so there is no scheduler state,
    and it does not depend on ``steps``: extending a run never changes an LR
    that was already used.
    """
    if step < tc.warmup_iters:
        return tc.lr * (step + 1) / (tc.warmup_iters + 1)
    if step >= tc.lr_decay_iters:
        return tc.min_lr
    ratio = (step - tc.warmup_iters) / (tc.lr_decay_iters - tc.warmup_iters)
    return tc.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (tc.lr - tc.min_lr)


def _warmup_probe_on(cfg: TrainerConfig) -> bool:
    return cfg.train.warmup_probe


def _quant_check_on(cfg: TrainerConfig) -> bool:
    return cfg.train.quant_check and cfg.model.quant != "none"


def pre_batches(cfg: TrainerConfig) -> int:
    """Probe batches a fresh run consumes before step 0.

    Derived from the same two predicates that gate the probes in
    :func:`run_probes`, so the stream offset rule (design record item 6) cannot
    drift from what the probes actually read.
    """
    return int(_warmup_probe_on(cfg)) + int(_quant_check_on(cfg))


def expected_offset(cfg: TrainerConfig, step: int, skipped: int = 0) -> int:
    """The stream offset after ``step`` steps: ``(step + pre_batches + skipped) * batch * seq_len``.

    ``skipped`` counts the batches spike rollbacks skipped (spec/rollback.md R-R05);
    it is run state, stored in the rollback record, and 0 without rollbacks.
    """
    return (step + pre_batches(cfg) + skipped) * cfg.data.batch * cfg.data.seq_len


def _forward(
    run: Run, x: torch.Tensor, y: torch.Tensor, depth: int, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The student's forward (through DDP / FSDP2): the next-byte loss, and the predictions at ``mask``."""
    bias = run.ngram.logit_bias(run.cfg.model.ngram_weight) if run.ngram is not None else None
    logits, pred = run.net(x, depth=depth, bias=bias, mask=mask)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)), pred


def _lm_loss(run: Run, x: torch.Tensor, y: torch.Tensor, depth: int) -> torch.Tensor:
    return _forward(run, x, y, depth)[0]


def _quant_error(run: Run) -> float:
    return max(layer.quant_error(8, full_tensor(layer.weight)) for layer in run.model.factor_layers())


@torch.no_grad()
def run_probes(run: Run, log: Log) -> list[dict[str, Any]]:
    """The probe forwards before step 0; each gate consumes one stream batch.

    * warm-up (``--warmup-probe``): two forwards on one batch must give the same
      loss bit for bit, or the environment is not deterministic and no resume of
      this run could be trusted;
    * quant check (``--quant-check`` with ``--quant int8``): the int8 forward on
      one batch; a non-finite loss or a quant error over ``--quant-threshold``
      latches fp32 before the first step.

    Returns:
        The probe rows for the history.

    Raises:
        ReplayDivergence: the two warm-up forwards differ.
    """
    cfg, rows = run.cfg, []
    depth = cfg.model.n_layer
    if _warmup_probe_on(cfg):
        x, y = run.stream.next_batch(cfg.data.batch, cfg.data.seq_len)
        first_t, second_t = _lm_loss(run, x, y, depth), _lm_loss(run, x, y, depth)
        first, second = run.ranks.mean(first_t).item(), run.ranks.mean(second_t).item()
        if run.ranks.any(f32_bits(first_t.item()) != f32_bits(second_t.item())):  # every rank's own forward
            raise ReplayDivergence(
                f"warm-up probe: the same forward on the same batch gave {first!r} then {second!r}; this "
                "environment is not deterministic (thread count, kernels), so no resume of this run could be "
                "checked; see ReplayDivergence's docstring for the usual causes"
            )
        rows.append(
            {"kind": "probe", "step": 0, "probe": "warmup", "loss": json_float(first), "loss_bits": f32_bits(first)}
        )
        log(f"warm-up probe: start loss {first:.4f} (ln 256 = {math.log(256):.4f}), forward deterministic")
    if _quant_check_on(cfg):
        x, y = run.stream.next_batch(cfg.data.batch, cfg.data.seq_len)
        quant_loss = run.ranks.mean(_lm_loss(run, x, y, depth)).item()
        error = _quant_error(run)
        bad = not math.isfinite(quant_loss) or error > cfg.train.quant_threshold  # the same on every rank
        if bad:
            run.latch_fp32()
            log(
                f"quant check: int8 loss {quant_loss:.4f}, quant error {error:.4g} "
                f"(threshold {cfg.train.quant_threshold}): LATCHED fp32 for the whole run"
            )
        rows.append(
            {
                "kind": "probe",
                "step": 0,
                "probe": "quant_check",
                "loss": json_float(quant_loss),
                "loss_bits": f32_bits(quant_loss),
                "quant_error": json_float(error),
                "quant_error_bits": f64_bits(error),
                "latched": bad,
            }
        )
    return rows


# ----------------------------------------------------------------------------- build


def build(cfg: TrainerConfig, data: bytes | None = None) -> Run:
    """Data, model, teacher, n-gram table, optimizer and monitor for ``cfg``, at step 0.

    Draws no global randomness: parameters come from
    ``rng.torch_generator(seed, 0, Stream.INIT)``, the same on every rank. Under
    torchrun the student is wrapped as ``--parallel`` says (R-T14).

    Args:
        cfg: the config.
        data: the training bytes, if already loaded (else read from ``cfg.data.path``).

    Raises:
        ValueError: the global batch does not split evenly over the ranks.
    """
    tc, where = cfg.train, ranks()
    check_fits(cfg, where)
    # -- data: this rank's rows of each global batch --
    stream = ByteStream(load_bytes(cfg.data.path) if data is None else data, rank=where.rank, world=where.world)
    # -- model (a DDP wrapper or FSDP2 shards under torchrun) --
    model = GPT(cfg.model, predictor=tc.aux)
    model.init_weights(torch_generator(tc.seed, 0, Stream.INIT))
    teacher = make_teacher(model) if tc.aux else None
    net = wrap(model, teacher, tc.parallel, where)
    ngram = BigramTable() if cfg.model.ngram else None
    # -- optimizer: decay matrices and embeddings, not norms or vectors (nanoGPT) --
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=get_lr(0, tc), betas=(tc.beta1, tc.beta2), foreach=False)
    monitor = SpikeMonitor(cfg.monitor)
    run = Run(cfg, stream, model, teacher, ngram, optimizer, monitor, net, where)
    run.apply_compute_settings()
    perturb_target(cfg, model)  # refuse a --perturb-param that names no parameter now, not at that step
    return run


# ----------------------------------------------------------------------------- one step


def _mask(run: Run, step: int) -> torch.Tensor | None:
    """This rank's rows of the step's JEPA mask (one per sequence of the global batch, a
    function of (seed, step): design record item 3); None when there is no aux loss or
    nothing in the global batch is masked (the same answer on every rank)."""
    cfg, tc = run.cfg, run.cfg.train
    if run.teacher is None:
        return None
    rows = mask_stream(cfg.data.seq_len, tc.mask_frac, tc.mask_span, seed=tc.seed, step=step, rows=cfg.data.batch)
    return torch.from_numpy(rows[run.ranks.rows(cfg.data.batch)]) if rows.any() else None


def _aux_loss(run: Run, x: torch.Tensor, pred: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor | None:
    """JEPA-style: the student, seeing the mask embedding at masked positions,
    predicted the teacher's (layer-normed) hidden states there (``pred``)."""
    if run.teacher is None:
        return None
    if pred is None or mask is None:  # an empty mask
        return torch.zeros((), dtype=torch.float32)
    with torch.no_grad():
        target = run.teacher.hidden(x, depth=run.cfg.model.n_layer)[mask]
        target = F.layer_norm(target, target.shape[-1:])
    if not bool(mask.any()):  # only other ranks' rows are masked: no loss here, but the same graph (FSDP2)
        return pred.sum() * 0.0
    return F.mse_loss(pred, target)


def _latch_before_forward(run: Run, step: int) -> str | None:
    """Latch the fp32 fallback before this step's int8 forward if it is due; returns why, or None."""
    tc = run.cfg.train
    if not run.quant_active:
        return None
    latch = None
    if step == run.cfg.testing.trip_latch_at:
        latch = f"--trip-latch-at {step} (testing aid)"
    else:
        error = _quant_error(run)
        if error > tc.quant_threshold:
            latch = f"quant error {error:.4g} > --quant-threshold {tc.quant_threshold}"
    if latch:
        run.latch_fp32()
    return latch


def train_step(run: Run, step: int) -> StepResult:
    """One optimisation step; reads only the run's state, the stream and (seed, step).

    The loop calls this once per step, through the spike guard, which observes
    the grad norm (:func:`observed_step` does the same without a guard); a later
    rollback can re-run it from a restored state and get the same result.
    """
    cfg, tc = run.cfg, run.cfg.train
    t0 = time.perf_counter()
    # -- this step's inputs: the stream, and randomness as a function of (seed, step) --
    x, y = run.stream.next_batch(cfg.data.batch, cfg.data.seq_len)
    n_layer = cfg.model.n_layer
    depth = sample_depth(n_layer, tc.min_depth, seed=tc.seed, step=step) if tc.rand_depth else n_layer
    # -- the one-way fp32 fallback, checked before the forward: a bad int8 step never trains --
    latch = _latch_before_forward(run, step)
    # -- forward (every rank latches if one rank's int8 loss is not finite) --
    mask = _mask(run, step)
    lm_loss, pred = _forward(run, x, y, depth, mask)
    if run.quant_active and run.ranks.any(not bool(torch.isfinite(lm_loss))):
        latch = "non-finite int8 loss"
        run.latch_fp32()
        lm_loss, pred = _forward(run, x, y, depth, mask)  # this step trains the fp32 forward
    compute = "int8" if run.quant_active else "fp32"
    aux_loss = _aux_loss(run, x, pred, mask)
    loss = lm_loss if aux_loss is None else lm_loss + tc.aux_weight * aux_loss
    # -- backward; the guard's monitor sees the grad norm before clipping (reduced: the same on every rank) --
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for p in run.model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip if tc.grad_clip > 0 else math.inf, foreach=False)
    grad_norm_value = full_tensor(grad_norm).item()
    # -- update: optimizer, then the EMA teacher and the n-gram table, outside autograd --
    lr = get_lr(step, tc) * run.lr_scale  # after the schedule and any optimizer load (spec/rollback.md R-R06)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.step()
    with torch.no_grad():
        if run.teacher is not None:
            for t, s in zip(run.teacher.parameters(), run.model.parameters(), strict=True):
                t.lerp_(s, 1.0 - tc.ema_decay)
        if run.ngram is not None:
            run.ngram.update(x, y, run.ranks.sum_)  # the whole global batch's pairs, on every rank
    step_ms = (time.perf_counter() - t0) * 1e3
    perturb(run, step)  # TESTING AID (--perturb-at): 1 ulp on one parameter, so a replay can diverge
    # -- what the row says: the mean over the ranks --
    losses = run.ranks.mean(torch.stack([loss, lm_loss, torch.zeros(()) if aux_loss is None else aux_loss]))
    return StepResult(
        step=step,
        loss=losses[0].item(),
        lm_loss=losses[1].item(),
        aux_loss=None if aux_loss is None else losses[2].item(),
        grad_norm=grad_norm_value,
        lr=lr,
        depth=depth,
        compute=compute,
        latch=latch,
        verdict=None,
        offset=run.stream.offset,
        step_ms=step_ms,
        param_digests=param_digests(run.model),  # fingerprints: spec/replay.md R-P01
        data=data_digest((x, y)),  # what it consumed: a resume fed other data is named as such (R-D26)
    )


def observed_step(run: Run, step: int) -> StepResult:
    """:func:`train_step` through the run's guard (:func:`spike_guard`: its monitor and
    testing aids), for a re-run that needs the step's row: the replay of a range in
    which the recording neither re-ran nor rolled back (one that did is replayed by
    :func:`train` itself).

    Raises:
        ReplayDivergence: the step rolled back here, though the recording did not.
    """
    assert run.guard is not None, "spike_guard(run, rs) first"
    outcome = run.guard.step(step, lambda s: train_step(run, s))
    if isinstance(outcome, RolledBack):
        raise ReplayDivergence(
            f"step {step} rolled back to step {outcome.to} in the replay, but not in the "
            "recording; see ReplayDivergence's docstring for the usual causes"
        )
    return _judged(outcome.executed)


# ----------------------------------------------------------------------------- the whole run


@contextlib.contextmanager
def deterministic_torch() -> Iterator[None]:
    """Deterministic kernels for the duration of a run, restored afterwards.

    The thread count is *not* forced: it is recorded as an environment fact
    (``environment.json``, the ``start`` history row), and a resume under another
    count is refused unless ``--allow-env-change``.
    """
    was = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    _deterministic_algorithms(True)
    try:
        yield
    finally:
        _deterministic_algorithms(was, warn_only=warn_only)


def _deterministic_algorithms(mode: bool, *, warn_only: bool = False) -> None:
    """torch's deterministic-kernels flag. ``torch.use_deterministic_algorithms`` sets the compiler's
    own flag too, importing the compiler (``torch._inductor``) to do it: 0.3 s of every trainer
    process's start, for a trainer that compiles nothing. The compiler's flag is set when it is
    loaded already."""
    if "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    else:
        torch._C._set_deterministic_algorithms(mode, warn_only=warn_only)


@contextlib.contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` for the duration (None: left as it is), then restored.

    The count is an environment fact of the run (spec/determinism.md R-D09): a
    resume or replay under another count is refused unless the environment
    change is allowed.
    """
    if n is None:
        yield
        return
    was = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(was)


def run_state(
    run: Run,
    run_dir: str | os.PathLike[str],
    fingerprint: dict[str, Any],
    *,
    log: Log | None = None,
    exempt: Iterable[str] = DEFAULT_EXEMPT,
    async_save: bool = False,
) -> RunState:
    """The :class:`RunState` of ``run``: everything a checkpoint carries, registered once.

    :func:`train` and the replay (``ckptkit.trainer._replay``) both use it, so a replay
    restores exactly what a resume restores.

    Args:
        run: what :func:`build` made.
        run_dir: where checkpoints are saved and resumed from.
        fingerprint: the training data's :func:`~ckptkit.trainer._data.data_fingerprint`.
        log: notes from a resume.
        exempt: config keys a resume may see changed (the replay adds its overrides).
        async_save: write checkpoints in the background (same bytes; the loop stalls
            only for the in-memory snapshot).
    """
    cfg = run.cfg
    rs = RunState(run_dir, config=cfg, keep=cfg.train.keep, log=log, exempt=exempt, async_save=async_save)
    rs.add_model("model", run.net)  # the DDP wrapper or the FSDP2 module: its layout is part of the run
    rs.add_optimizer("adamw", run.optimizer)
    if run.teacher is not None:
        rs.add_teacher(run.teacher)  # item 1: restored as saved, frozen; never rebuilt
    rs.add_monitor("spike", run.monitor)  # item 4: the stability report survives a resume
    rs.add_data_position(
        "train",
        get=lambda: run.stream.offset,
        set=run.stream.seek,  # item 6, spec/rollback.md R-R05:
        expected=lambda step, values: expected_offset(cfg, step, skipped_batches(values)),
    )
    rs.add_value("data", get=lambda: fingerprint, set=lambda stored: _check_same_data(stored, fingerprint, cfg))
    rs.add_flag(
        "fp32_fallback", get=lambda: run.fp32_latched, set=lambda latched: setattr(run, "fp32_latched", latched)
    )  # item 2
    if run.ngram is not None:
        rs.add_sidecar("ngram", get=run.ngram.sidecar, set=run.ngram.load_sidecar)  # item 7
    rs.after_restore(run.apply_compute_settings)  # the forward follows the restored latch
    return rs


def spike_guard(
    run: Run,
    rs: RunState,
    *,
    save: Callable[[int], object] | None = None,
    on_step: Callable[[Executed], None] | None = None,
    log: Log | None = None,
) -> SpikeGuard:
    """The library's :class:`~ckptkit.SpikeGuard` configured by ``--auto-rollback`` and the
    ``--rollback-*`` knobs, on ``rs`` (after :func:`run_state`); sets ``run.guard``.

    With ``on`` it registers the rollback record (``values.rollback``), with ``--spike-at``
    the testing aid's arrival count (``values.spike_injection``): build it wherever the
    run is restored (train, replay), before ``resume()``.
    """
    tc = run.cfg.train
    inject = None
    aids = run.cfg.testing
    if aids.spike_at is not None:  # TESTING AID (spec/rollback.md R-R11): armed by the guard, not the step
        inject = GradSpike([run.model], at=aids.spike_at, repeat=1 if aids.spike_transient else aids.spike_repeat)
    config = RollbackConfig(
        mode=tc.auto_rollback.value,
        k=tc.rollback_k,
        lr_drop=tc.lr_drop,
        skip_data=RollbackSkip(tc.rollback_skip) is RollbackSkip.WINDOW,
        data="train",
        bound=tc.rollback_bound,
        cap=tc.rollback_cap,
    )
    run.guard = SpikeGuard(
        rs,
        config,
        monitor=run.monitor,
        lr=lambda step: get_lr(step, tc),
        save=save,
        on_step=on_step,
        prepare=lambda: run_probes(run, lambda _msg: None),
        inject=inject,
        log=log,
    )
    return run.guard


def train(
    cfg: TrainerConfig,
    run_dir: str | os.PathLike[str],
    *,
    resume: bool = False,
    reshard: bool = False,
    allow_legacy: bool = False,
    allow_env_change: bool = False,
    resume_check: str | None = None,
    log: Log | None = _stderr,
    on_step: Callable[[StepResult], None] | None = None,
    preemptible: bool = False,
) -> TrainResult:
    """Train ``cfg`` in ``run_dir`` until ``cfg.train.steps`` steps are done.

    Under torchrun every rank calls it (spec/trainer.md R-T14); rank 0 logs and
    writes the history.

    Args:
        cfg: the resolved config (the plan; snapshotted and diffed on resume).
        run_dir: the run directory: checkpoints, snapshots, sidecars,
            ``environment.json`` and ``history.jsonl``.
        resume: continue from the newest consistent checkpoint; otherwise start
            fresh (refused if the directory already holds checkpoints).
        reshard: with ``resume``, accept another world size or layout than the
            checkpoint's (recorded: the run is no longer bit-comparable to its past).
        allow_legacy: accept a v1 checkpoint that lacks state (recorded in history).
        allow_env_change: accept a different environment (recorded in history).
        resume_check: with ``resume``, what a difference between the steps re-run and the rows
            the interrupted run recorded for them does: ``"error"`` (default), ``"warn"``, ``"off"``
            (:meth:`RunState.resume`, spec/determinism.md R-D24).
        log: progress and notes (default: stderr); None for silence.
        on_step: called after each step's history row is written (tests, tools).
        preemptible: SIGTERM / SIGINT request a stop (:meth:`RunState.preemptible`):
            the step in progress finishes, is saved, and :class:`RunStopped` is raised.
            ``CKPTKIT_STOP_AT`` is honoured either way.

    Returns:
        A :class:`TrainResult`.

    Raises:
        ResumeRefused: a fresh start in a directory with checkpoints, or a resume
            that would continue a different run: ConfigDrift, EnvironmentDrift,
            StreamOffsetMismatch, LegacyCheckpoint, other training bytes.
        CheckpointNotFound: ``resume`` and no consistent checkpoint.
        SidecarMismatch: the n-gram table does not belong to the checkpoint's step.
        ReplayDivergence: the warm-up probe found a nondeterministic forward.
        SaveFailed: a checkpoint could not be written (earlier ones are intact).
        RunStopped: a stop was requested (a signal with ``preemptible``, ``CKPTKIT_STOP_AT``);
            the checkpoint at the step reached is committed.

    Example:
        >>> cfg = TrainerConfig().replace(**{"train.steps": 20})  # doctest: +SKIP
        >>> train(cfg, "runs/a")  # doctest: +SKIP
        >>> train(cfg.replace(**{"train.steps": 40}), "runs/a", resume=True)  # doctest: +SKIP
    """
    log = log or (lambda _msg: None)
    with deterministic_torch():
        # -- data, model, optimizer (fresh at step 0; a resume overwrites them) --
        data = load_bytes(cfg.data.path)
        fingerprint = data_fingerprint(data)
        run = build(cfg, data)
        log = log if run.ranks.rank == 0 else (lambda _msg: None)  # under torchrun rank 0 speaks and records

        # -- run state: everything a checkpoint carries, registered once --
        rs = run_state(run, run_dir, fingerprint, log=log, async_save=True)
        recorder = _Recorder(rs, on_step)

        # -- what a spike verdict does (--auto-rollback; spec/rollback.md) --
        guard = spike_guard(run, rs, save=recorder.save, on_step=recorder.emit, log=log)
        step_fn = functools.partial(train_step, run)

        with contextlib.ExitStack() as closing:  # on any exit: the stop handlers, then rs and its history
            closing.callback(rs.close)  # the last background save is committed (or its error raised) before we return
            if preemptible:  # SIGTERM / SIGINT: finish the step, save it, stop (spec/runstate.md)
                closing.enter_context(rs.preemptible())

            # -- start or resume --
            notes: list[str] = []
            # rank 0 looks (before its start sweeps what it found), every rank follows
            if resume and run.ranks.any(run.ranks.rank == 0 and rs.never_saved()):
                log("no checkpoint was committed before the run stopped: starting it again from step 0")
                resume = False
            if resume:
                how = _How(reshard, allow_legacy, allow_env_change, resume_check)
                start, notes = _resume(run, rs, step_fn, how, log)
            else:
                start = _start(run, rs, fingerprint, log)

            # -- the loop, then the final save --
            final, path = _loop(run, rs, guard, recorder, step_fn, start, resumed=resume, log=log)
    return TrainResult(
        final,
        path,
        place_for(run_dir).child(HISTORY_FILE),
        run.fp32_latched,
        run.monitor.report(),
        tuple(notes),
        rollback=guard.record.state() if guard.on else None,
    )


class _Recorder:
    """Where the loop and the guard put a step's rows and a checkpoint, in the order a replay checks them:
    through the run's history (:attr:`RunState.history`, rank 0's)."""

    def __init__(self, rs: RunState, on_step: Callable[[StepResult], None] | None) -> None:
        self._rs, self._on_step = rs, on_step

    def emit(self, e: Executed) -> None:
        """A step's rows, re-runs included (the guard calls it); then ``on_step``."""
        result = _judged(e)
        fields = result.row()
        del fields["kind"], fields["step"]
        # The trainer's step row (spec/trainer.md) and its parameters' digests (spec/replay.md R-P02).
        self._rs.record(result.step, fields=fields, digests=result.param_digests or {})
        if self._on_step is not None:
            self._on_step(result)

    def save(self, step: int) -> str:
        """Every checkpoint, the guard's rolled-back state included: its row first, synced, then the save."""
        self._rs.history.append(checkpoint_row(self._rs, step))  # spec/replay.md R-P03
        self._rs.history.sync()  # every row before the checkpoint is on disk before it
        return self._rs.save(step)


def _loop(
    run: Run,
    rs: RunState,
    guard: SpikeGuard,
    recorder: _Recorder,
    step_fn: Callable[[int], StepResult],
    start: int,
    *,
    resumed: bool,
    log: Log,
) -> tuple[int, str | None]:
    """Steps from ``start`` to ``--steps``: the log line, the checkpoint and the stop check of each,
    then the final save; returns (the step reached, the newest checkpoint this call wrote).

    A spike rollback sends ``step`` back (spec/rollback.md).

    Raises:
        RunStopped: a stop was requested; the checkpoint at the step reached is committed.
    """
    tc = run.cfg.train
    last_saved = start if resumed else None
    path = None
    if start >= tc.steps and resumed:
        log(f"the run is at step {start} and --steps is {tc.steps}: nothing to train")
    step = start
    while step < tc.steps:
        outcome = guard.step(step, step_fn)  # warn: a spike row; on: re-run, then roll back or stop
        if isinstance(outcome, RolledBack):  # training goes on from the restored step
            step = outcome.to
            continue
        result = _judged(outcome.executed)
        done = step + 1
        if done % tc.log_every == 0 or done == tc.steps or result.latch or outcome.executed.verdict.is_spike:
            log(result.line(tc.steps))
        if done % tc.ckpt_every == 0 or done == tc.steps:
            path = recorder.save(done)
            last_saved = done
        why = run.ranks.agree(rs.stop_requested(done))  # preemption, CKPTKIT_STOP_AT: save, stop
        if why is not None:
            path = path if last_saved == done and path is not None else recorder.save(done)
            rs.wait()
            raise RunStopped(done, path, why)
        step = done
    final = max(start, tc.steps)
    if last_saved != final:  # a fresh run of 0 steps still leaves its step-0 checkpoint
        path = recorder.save(final)
    return final, path


def _start(run: Run, rs: RunState, fingerprint: dict[str, Any], log: Log) -> int:
    """A fresh run: the run directory, the ``start`` and probe rows; returns step 0."""
    start = rs.start()
    history = rs.history  # a fresh file, opened by its first row
    history.append(
        {
            "kind": "start",
            "step": 0,
            "torch": torch.__version__,
            "intra_op_threads": torch.get_num_threads(),
            "data": fingerprint,
        }
    )
    for row in run_probes(run, log):
        history.append(row)
    return start


@dataclass(frozen=True)
class _How:
    """How a resume may differ from the run it continues, and how it judges itself."""

    reshard: bool
    allow_legacy: bool
    allow_env_change: bool
    resume_check: str | None


def _resume(run: Run, rs: RunState, step_fn: Callable[[int], StepResult], how: _How, log: Log) -> tuple[int, list[str]]:
    """Restore the newest consistent checkpoint and write the ``resume`` row (the trainer's, with
    every note: it replaces the one ``RunState`` writes under another environment); returns (step, notes)."""
    assert run.guard is not None
    info = rs.resume(
        reshard=how.reshard,
        allow_legacy=how.allow_legacy,
        allow_env_change=how.allow_env_change,
        resume_check=how.resume_check,
    )
    start = info.step
    notes = list(info.notes) + _after_resume(run, info, log)
    notes += rs.history.open()  # the rows after `start` (in its rollback timeline) set aside, said in the row
    notes += run.guard.rebuild(start, step_fn)  # --auto-rollback on: the ring, by a checked replay (R-R12)
    row = resume_row(info, allow_legacy=how.allow_legacy, allow_env_change=how.allow_env_change, notes=notes)
    rs.history.append(row)
    log(f"resumed {info.path} at step {start}; stream offset {run.stream.offset}")
    return start, notes


def _judged(e: Executed) -> StepResult:
    """A step's result with the guard's verdict and re-run flag (what its row shows)."""
    judged: StepResult = dataclasses.replace(e.result, verdict=e.verdict, rerun=e.rerun)
    return judged


def _check_same_data(stored: Any, fingerprint: dict[str, Any], cfg: TrainerConfig) -> None:
    if stored != fingerprint:
        raise ResumeRefused(
            f"the training bytes differ from the run's: recorded {stored}, now {fingerprint} "
            f"(--data {cfg.data.path or '(shipped corpus)'}); a resume on other data is another run"
        )


def _after_resume(run: Run, info: Any, log: Log) -> list[str]:
    """Checks and notes that need the restored step; returns the notes."""
    notes = []
    if run.ngram is not None and run.ngram.table_step != info.step:
        raise SidecarMismatch(
            "ngram table step differs from the training step (the table is updated once per step)",
            path=info.path + ".ngram",
            field="table_step",
            expected=info.step,
            actual=run.ngram.table_step,
        )
    if run.teacher is not None and "teacher" in info.legacy_missing:
        # A v1 checkpoint has no teacher. The least-wrong teacher is a copy of the
        # restored student -- exactly the pre-ADR-0021 behaviour -- so say so loudly.
        run.teacher.load_state_dict(run.model.state_dict())
        notes.append(
            "teacher: the legacy checkpoint carries none; rebuilt as a copy of the restored student, "
            "so the auxiliary target differs from the original run's"
        )
    if run.fp32_latched:
        notes.append("fp32 fallback is latched (restored from the checkpoint): the forward runs fp32 factors")
    for n in notes:
        log(n)
    return notes
