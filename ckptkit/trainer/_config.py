"""The reference trainer's config: three tables, the testing aids and the spike monitor, every knob a key.

The config is the *plan* of a run (design record ADR-0021 §1). Every field is in
the snapshot written next to each checkpoint and is diffed on resume: only the
keys that decide when we look (``steps``, ``log_every``, ``ckpt_every``) may
change; anything else that differs refuses the resume with ``ConfigDrift``.
``tests/trainer/test_trainer_items.py::test_item8_snapshot_carries_every_config_field`` pins
that (design record item 8).

Each field's help text is its comment: units and allowed values. The command
line (``ckptkit train``) has one flag per field, named after the field
(``--seq-len`` is ``data.seq_len``) unless the field says otherwise.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any

from ..format._checks import check_u64, is_int, is_number
from ..guard._monitor import SpikeConfig

__all__ = [
    "QUANT_FORMATS",
    "DataConfig",
    "ModelConfig",
    "Parallel",
    "RollbackMode",
    "RollbackSkip",
    "TestingAids",
    "TrainConfig",
    "TrainerConfig",
    "flag_name",
    "help_text",
    "knobs",
]

QUANT_FORMATS = ("none", "int8")


def _knob(default: Any, help: str, *, flag: str | None = None) -> Any:  # noqa: A002 - argparse's word
    """A config field with its comment kept as data, so ``--help`` shows it too."""
    meta = {"help": help} if flag is None else {"help": help, "flag": flag}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    """The network: a tiny byte-level GPT (vocabulary = the 256 byte values)."""

    n_layer: int = _knob(2, "transformer blocks, >= 1")
    n_head: int = _knob(2, "attention heads per block, >= 1, divides --d-model")
    d_model: int = _knob(64, "residual stream width (channels), >= 1, a multiple of --n-head")
    block_size: int = _knob(64, "longest sequence the position table holds (bytes), >= --seq-len")
    quant: str = _knob(
        "none",
        "factor-weight compute format: none (fp32) or int8 (fake-quantized, "
        "straight-through gradients; fp32 master weights)",
    )
    ngram: bool = _knob(
        True, "add the bigram logit-bias table (updated outside autograd, saved as the .ngram sidecar) to the logits"
    )
    ngram_weight: float = _knob(1.0, "scale of the bigram log-probability bias added to the logits, >= 0")

    def __post_init__(self) -> None:
        _positive(self, "n_layer", "n_head", "d_model", "block_size")
        if self.d_model % self.n_head:
            raise ValueError(f"--d-model must be a multiple of --n-head (got {self.d_model} and {self.n_head})")
        if self.quant not in QUANT_FORMATS:
            raise ValueError(f"--quant must be one of {', '.join(QUANT_FORMATS)} (got {self.quant!r})")
        _finite(self, "ngram_weight", low=0.0)


@dataclass(frozen=True)
class DataConfig:
    """The training bytes: one file read as an endless byte stream."""

    path: str = _knob(
        "",
        "training file, read as raw bytes and wrapped at EOF; empty = the corpus "
        "shipped in ckptkit/trainer/data/corpus.txt",
        flag="--data",
    )
    seq_len: int = _knob(32, "bytes per training sequence, 1 ..= --block-size")
    batch: int = _knob(8, "sequences per step, >= 1 (a step consumes batch * seq_len bytes)")

    def __post_init__(self) -> None:
        _positive(self, "seq_len", "batch")


class RollbackMode(str, enum.Enum):
    """``--auto-rollback``: what the trainer does with a spike verdict (spec/rollback.md R-R01)."""

    OFF = "off"  # the monitor keeps its statistics; nothing else
    WARN = "warn"  # a spike row in history.jsonl; the update is kept
    ON = "on"  # re-run the step; a confirmed spike rolls back, drops the LR, skips the window


class Parallel(str, enum.Enum):
    """``--parallel``: how the student is spread over the ranks under torchrun (spec/trainer.md R-T14)."""

    DDP = "ddp"  # replicated; gradients all-reduced (DistributedDataParallel)
    FSDP = "fsdp"  # sharded per block and at the root (FSDP2 ``fully_shard``)


class RollbackSkip(str, enum.Enum):
    """``--rollback-skip``: the batches between the rollback step and the spike (R-R05)."""

    WINDOW = "window"  # skipped: the stream keeps its position (PaLM)
    NONE = "none"  # replayed from the restored position, with the lower LR


@dataclass(frozen=True)
class TrainConfig:
    """The loop: optimisation, cadence, auxiliary loss, quantization and depth."""

    # -- progress and cadence (exempt from drift: they decide when we look) --
    steps: int = _knob(200, "train until this many steps are done (a resume may extend it), >= 0")
    ckpt_every: int = _knob(50, "checkpoint every N steps (the final step always is), >= 1")
    log_every: int = _knob(10, "one progress line on stderr every N steps, >= 1")
    # -- retention: strict like everything not in the exempt class (ADR-0021) --
    keep: int = _knob(3, "newest checkpoints kept on disk, >= 1")
    # -- randomness --
    seed: int = _knob(1, "the run seed: every random number is a function of (seed, step), 0 ..< 2**64")
    # -- optimisation (AdamW, warmup then cosine decay; the LR is a function of the step) --
    lr: float = _knob(3e-3, "peak learning rate, > 0")
    min_lr: float = _knob(3e-4, "learning rate after the cosine decay, 0 ..= --lr")
    warmup_iters: int = _knob(10, "linear LR warmup (steps), >= 0")
    lr_decay_iters: int = _knob(
        2000,
        "cosine decay ends at this step; independent of --steps so "
        "extending a run never changes an LR already used, >= --warmup-iters",
    )
    weight_decay: float = _knob(0.1, "AdamW decoupled weight decay on matrices, >= 0")
    beta1: float = _knob(0.9, "AdamW first-moment decay, 0 ..< 1")
    beta2: float = _knob(0.99, "AdamW second-moment decay, 0 ..< 1")
    grad_clip: float = _knob(1.0, "clip the global grad norm to this; 0 = no clipping, >= 0")
    # -- probes before step 0 (they consume stream batches: the stream offset rule) --
    warmup_probe: bool = _knob(
        True,
        "before step 0, two no-grad forwards on one probe batch check "
        "the start loss is finite and the forward deterministic",
    )
    quant_check: bool = _knob(
        False,
        "with --quant int8, before step 0 one probe batch checks the quantized forward; a bad one latches fp32 at once",
    )
    # -- int8 fake quantization and its one-way fp32 fallback latch --
    quant_threshold: float = _knob(
        0.05,
        "latch fp32 for the rest of the run when a factor matrix's relative int8 error |q(W)-W|/|W| exceeds this, > 0",
    )
    # -- auxiliary masked-prediction loss against an EMA teacher (JEPA-style) --
    aux: bool = _knob(True, "add the masked hidden-state prediction loss against the EMA teacher")
    aux_weight: float = _knob(0.5, "weight of the auxiliary loss in the total loss, >= 0")
    ema_decay: float = _knob(0.99, "teacher EMA decay per step: t = d*t + (1-d)*student, 0 ..= 1")
    mask_frac: float = _knob(0.15, "span-start budget of the per-step mask, fraction of positions, 0 ..= 1")
    mask_span: int = _knob(4, "masked span length (positions), >= 1")
    # -- stochastic depth: blocks used per step drawn from the (seed, step) stream --
    rand_depth: bool = _knob(
        False, "use a random number of blocks each step, uniform in [--min-depth, --n-layer], drawn from (seed, step)"
    )
    min_depth: int = _knob(1, "smallest depth --rand-depth samples, 1 ..= --n-layer")
    # -- data parallelism under torchrun (one process: nothing is wrapped) --
    parallel: Parallel = _knob(
        Parallel.DDP,
        "under torchrun: ddp (replicated student, gradients all-reduced) or fsdp (FSDP2: "
        "parameters, gradients and AdamW moments sharded); part of the run, so a resume "
        "under the other is drift",
    )
    # -- what a spike verdict does (spec/rollback.md R-R01..R-R12; monitor knobs are --spike-*) --
    auto_rollback: RollbackMode = _knob(
        RollbackMode.WARN,
        "on a spike: off (statistics only), warn (a spike "
        "row in the history; the update is kept), on (re-run the step once; "
        "a spike again rolls back --rollback-k steps and drops the LR)",
    )
    rollback_k: int = _knob(10, "roll back to this many steps before the spiking step (steps), >= 0")
    lr_drop: float = _knob(
        0.5,
        "multiply the LR by this at every rollback, for the rest of the run (applied after the schedule), > 0 and <= 1",
    )
    rollback_skip: RollbackSkip = _knob(
        RollbackSkip.WINDOW,
        "after a rollback: window (skip the batches "
        "from the rollback step to the spike, as PaLM did) or none (replay "
        "them with the lower LR)",
    )
    rollback_bound: int = _knob(
        3,
        "the run stops (training is unstable) at this many consecutive spikes, "
        "so at most bound-1 rollbacks in a row, >= 1",
    )
    rollback_cap: int = _knob(10, "the run stops when a spike would need rollback number cap+1 (whole run), >= 0")

    def __post_init__(self) -> None:
        _positive(self, "ckpt_every", "log_every", "keep", "mask_span", "min_depth")
        _non_negative(self, "steps", "warmup_iters")
        check_u64("--seed", self.seed)
        _finite(self, "lr", low=0.0, strict=True)
        _finite(self, "min_lr", low=0.0)
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr must be <= --lr (got {self.min_lr} > {self.lr})")
        if self.lr_decay_iters < self.warmup_iters:
            raise ValueError(
                f"--lr-decay-iters must be >= --warmup-iters (got {self.lr_decay_iters} < {self.warmup_iters})"
            )
        _finite(self, "weight_decay", "grad_clip", "aux_weight", low=0.0)
        _finite(self, "beta1", "beta2", low=0.0, high=1.0, high_open=True)
        _finite(self, "quant_threshold", low=0.0, strict=True)
        _finite(self, "ema_decay", "mask_frac", low=0.0, high=1.0)
        _enum_value(self, "parallel", Parallel)
        _check_rollback(self)


@dataclass(frozen=True)
class TestingAids:
    """Faults the trainer plants on purpose: the tests and ``ckptkit audit`` use them to
    show that a resume, a replay, a rollback or the fp32 latch catches what it should.

    Not knobs of a real run, so not in :class:`TrainConfig`; the command line builds
    this table from its ``--trip-latch-at``, ``--perturb-*`` and ``--spike-*`` flags.
    A run planted with one is another run: the snapshot records them (its ``testing``
    table), a resume must repeat them, and a replay repeats them from the snapshot.
    """

    __test__ = False  # its name starts with "Test": pytest must not collect it where a test imports it

    # -- the int8 fallback latch (spec/trainer.md R-T03) --
    trip_latch_at: int | None = _knob(
        None, "TESTING AID: latch fp32 at this step (as if the int8 check failed there); unset = never, >= 0"
    )
    # -- deliberate divergence, for testing replay and audit (spec/replay.md R-P10) --
    perturb_at: int | None = _knob(
        None,
        "TESTING AID: at the end of this step add 1 ulp to element 0 "
        "of --perturb-param, so the run diverges there; unset = never, >= 0",
    )
    perturb_param: str = _knob(
        "",
        "TESTING AID: the parameter --perturb-at changes, as the model names it "
        "(blocks.0.attn.qkv.weight); empty = the first parameter",
    )
    # -- planted nondeterminism, for testing the resume check (spec/determinism.md R-D25) --
    global_draw_from: int | None = _knob(
        None,
        "TESTING AID: from this step on, move element 0 of the first parameter by a draw from the "
        "global RNG (which no checkpoint restores), so a resumed process differs; unset = never, >= 0",
    )
    # -- an injected grad-norm spike, for testing --auto-rollback (spec/rollback.md R-R11) --
    spike_at: int | None = _knob(
        None,
        "TESTING AID: multiply the gradient (so the grad norm) by 10 at this "
        "step, on its execution and its re-run, not after a rollback; "
        "unset = never, >= 0",
    )
    spike_repeat: int = _knob(
        2,
        "TESTING AID: with --spike-at, fire on the first N arrivals at that step "
        "(execution, re-run, executions after rollbacks, ...), >= 1",
    )
    spike_transient: bool = _knob(
        False,
        "TESTING AID: with --spike-at, fire on the first arrival only, "
        "not on the re-run (a transient fault, not the data)",
    )

    def __post_init__(self) -> None:
        if self.trip_latch_at is not None:
            _non_negative(self, "trip_latch_at")
        if self.perturb_at is not None:
            _non_negative(self, "perturb_at")
        if self.global_draw_from is not None:
            _non_negative(self, "global_draw_from")
        if not isinstance(self.perturb_param, str):
            raise ValueError(f"--perturb-param must be a parameter name (got {self.perturb_param!r})")
        _positive(self, "spike_repeat")
        if self.spike_at is not None:
            _non_negative(self, "spike_at")
        if not isinstance(self.spike_transient, bool):
            raise ValueError(f"--spike-transient must be true or false (got {self.spike_transient!r})")


@dataclass(frozen=True)
class TrainerConfig:
    """The whole resolved config of a run: what its snapshot carries."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # The testing aids: strict like any other key, so a resume repeats a planted fault
    # and a replay reproduces it from the snapshot.
    testing: TestingAids = field(default_factory=TestingAids)
    # The spike monitor's detection parameters (ckptkit.monitor): changing them
    # changes the stability report, so they are strict like any other key. The
    # monitor's own defaults, the PRD's: window 50, multiplier 3x (spec/rollback.md R-R01).
    monitor: SpikeConfig = field(default_factory=SpikeConfig)

    def __post_init__(self) -> None:
        if self.data.seq_len > self.model.block_size:
            raise ValueError(f"--seq-len must be <= --block-size (got {self.data.seq_len} > {self.model.block_size})")
        if self.train.min_depth > self.model.n_layer:
            raise ValueError(f"--min-depth must be <= --n-layer (got {self.train.min_depth} > {self.model.n_layer})")

    def replace(self, **changes: Any) -> TrainerConfig:
        """A copy with dotted keys changed: ``cfg.replace(**{"train.lr": 1e-3})``.

        Raises:
            KeyError: a key names no field.
            ValueError: the new value breaks a field's rule (the message names the flag).
        """
        tables: dict[str, dict[str, Any]] = {}
        for key, value in changes.items():
            table, _, name = key.partition(".")
            if table not in _TABLES or name not in {f.name for f in dataclasses.fields(_TABLES[table])}:
                raise KeyError(f"{key!r} is not a config key (keys: {', '.join(sorted(k for k, _ in knobs()))})")
            tables.setdefault(table, {})[name] = value
        return dataclasses.replace(self, **{t: dataclasses.replace(getattr(self, t), **kv) for t, kv in tables.items()})

    @classmethod
    def from_table(cls, table: Any) -> TrainerConfig:
        """The config a snapshot's ``config`` table describes (``read_snapshot(p).config``).

        A key the table lacks takes its declared default (the snapshot rule R-S11);
        an enum-valued key is converted back from its written value.

        Raises:
            KeyError: the table has a key this trainer does not know (a newer or other trainer).
            ValueError: a value breaks a field's rule.
        """
        if not isinstance(table, dict):
            raise ValueError(f"a config table must be a dict (got {type(table).__name__})")
        defaults = cls()
        changes: dict[str, Any] = {}
        for name, sub in table.items():
            if not isinstance(sub, dict):
                raise KeyError(f"{name!r} is not a config table (tables: {', '.join(_TABLES)})")
            for leaf, value in sub.items():
                key = f"{name}.{leaf}"
                default = getattr(getattr(defaults, name, None), leaf, None)
                changes[key] = type(default)(value) if isinstance(default, enum.Enum) else value
        return defaults.replace(**changes)


_TABLES: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "testing": TestingAids,
    "monitor": SpikeConfig,
}

# SpikeConfig lives in ckptkit.monitor; its comments, as help, for the command line.
_MONITOR_HELP = {
    "window": "spike monitor: accepted grad norms in the rolling median, >= 1 (steps)",
    "multiplier": "spike monitor: a spike is grad_norm > multiplier * median, finite, > 0",
    "min_history": "spike monitor: accepted values before a grad-norm spike can trigger, 1 ..= window",
    "floor": "spike monitor: a grad norm <= floor is never a spike, finite, >= 0",
    "history": "spike monitor: recent values and spikes kept for the report, >= 0",
}


def knobs() -> list[tuple[str, dataclasses.Field[Any]]]:
    """Every config key as ``(dotted key, field)``, in declaration order.

    The command line has one flag per key; :func:`flag_name` gives its spelling.
    """
    return [(f"{table}.{f.name}", f) for table, cls in _TABLES.items() for f in dataclasses.fields(cls)]


def flag_name(key: str, f: dataclasses.Field[Any]) -> str:
    """The command-line flag of a config key: ``train.seq_len`` -> ``--seq-len``;
    monitor keys get a ``--spike-`` prefix; a field may name its own flag."""
    if "flag" in f.metadata:
        return str(f.metadata["flag"])
    table, _, name = key.partition(".")
    prefix = "spike-" if table == "monitor" else ""
    return "--" + prefix + name.replace("_", "-")


def help_text(key: str, f: dataclasses.Field[Any]) -> str:
    """The field's comment: units and allowed values."""
    if "help" in f.metadata:
        return str(f.metadata["help"])
    return _MONITOR_HELP.get(key.partition(".")[2], "")


# ------------------------------------------------------------------ validation helpers
# Messages name the flag as the user spells it: "--keep must be >= 1 (got 0)".


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _int_value(obj: Any, name: str) -> int:
    value = getattr(obj, name)
    if not is_int(value, least=None):
        raise ValueError(f"{_flag(name)} must be an integer (got {value!r})")
    return value


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = _int_value(obj, name)
        if value < 1:
            raise ValueError(f"{_flag(name)} must be >= 1 (got {value})")


def _non_negative(obj: Any, *names: str) -> None:
    for name in names:
        value = _int_value(obj, name)
        if value < 0:
            raise ValueError(f"{_flag(name)} must be >= 0 (got {value})")


def _finite(
    obj: Any, *names: str, low: float, high: float | None = None, strict: bool = False, high_open: bool = False
) -> None:
    for name in names:
        value = getattr(obj, name)
        if not is_number(value):
            raise ValueError(f"{_flag(name)} must be a number (got {value!r})")
        # One type in the snapshot: an int literal and argparse's float are the same knob.
        object.__setattr__(obj, name, float(value))
        ok = math.isfinite(value) and (value > low if strict else value >= low)
        if high is not None:
            ok = ok and (value < high if high_open else value <= high)
        if not ok:
            lo = f"> {low}" if strict else f">= {low}"
            hi = "" if high is None else f" and {'<' if high_open else '<='} {high}"
            raise ValueError(f"{_flag(name)} must be finite, {lo}{hi} (got {value})")


def _enum_value(obj: Any, name: str, kind: type[enum.Enum]) -> None:
    # argparse and replace() hand over the spelling ("on"); the config holds the member.
    value = getattr(obj, name)
    try:
        object.__setattr__(obj, name, kind(value))
    except ValueError:
        allowed = ", ".join(m.value for m in kind)
        raise ValueError(f"{_flag(name)} must be one of {allowed} (got {value!r})") from None


def _check_rollback(tc: Any) -> None:
    """The spike-rollback knobs of TrainConfig (spec/rollback.md R-R01)."""
    _enum_value(tc, "auto_rollback", RollbackMode)
    _enum_value(tc, "rollback_skip", RollbackSkip)
    _non_negative(tc, "rollback_k", "rollback_cap")
    _positive(tc, "rollback_bound")
    _finite(tc, "lr_drop", low=0.0, high=1.0, strict=True)
    if tc.auto_rollback is RollbackMode.ON and (tc.keep - 1) * tc.ckpt_every < tc.rollback_k:
        # R-R09: a rollback deletes the abandoned timeline's checkpoints before it saves its
        # target; a checkpoint at or before the target must then still be on disk.
        need = -(-tc.rollback_k // tc.ckpt_every) + 1
        raise ValueError(
            f"--auto-rollback on needs (--keep - 1) x --ckpt-every >= --rollback-k (got ({tc.keep} - 1) "
            f"x {tc.ckpt_every} < {tc.rollback_k}): a crash while a rollback is saved could leave no "
            f"checkpoint to resume from; use --keep {need} or more"
        )
