"""``ckptkit train``: the reference trainer (a tiny byte-level GPT) on the command line.

    ckptkit train --run-dir runs/a --steps 200
    ckptkit train --run-dir runs/a --steps 400 --resume
    ckptkit train --run-dir runs/q --steps 100 --quant int8 --quant-check --rand-depth --seed 7
    torchrun --nproc_per_node 2 -m ckptkit train --run-dir runs/d --steps 40 --ckpt-every 10
    torchrun --nproc_per_node 2 -m ckptkit train --run-dir runs/d --steps 80 --ckpt-every 10 --resume

One flag per config key (``ckptkit.trainer._config``); a resume must pass the same
knobs as the run it continues, except ``--steps``, ``--log-every`` and
``--ckpt-every``, or it is refused with the list of differences.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import io
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["URL_ARGS", "add_knobs", "add_parser", "config_from_args", "run"]

#: ``--run-dir`` may be an ``s3://`` prefix (one process; spec/objectstore.md).
URL_ARGS = ("run_dir",)

_EPILOG = """\
example:
  $ ckptkit train --run-dir runs/a --steps 100 --quant int8
  ckptkit train: warm-up probe: start loss 5.5423 (ln 256 = 5.5452), forward deterministic
  ckptkit train: step 10/100 | loss 3.3908 | lm 2.9129 | aux 0.9559 | gnorm 0.809 | lr 2.73e-03 | ...
  train: 100%|##########| 100/100 [00:01<00:00, 70.71step/s, loss=2.4655]   (on a terminal only)
  step 100: runs/a/step-00000100.ckpt
  summary:
    trained      100 step(s) (0 -> 100) in 1.9 s, 52.1 steps/s
    ...
    extend       ckptkit train --run-dir runs/a --steps 200 --resume --quant int8
  $ ckptkit train --run-dir runs/a --steps 200 --quant int8 --resume      # extend it

progress (stderr): a bar with rate and ETA when stderr is a terminal, the log lines
otherwise, nothing with --quiet; results and the summary go to stdout (README "What you
see when you train" explains each line). --threads N is part of the run: a resume under
another thread count is refused unless --allow-env-change (spec/cli.md "--threads").

files in the run directory: step-XXXXXXXX.ckpt (+ .config.json, .ngram), environment.json,
history.jsonl (one row per step, exact floats; spec/trainer.md)

spike rollback (spec/rollback.md):
  $ ckptkit train --run-dir runs/b --steps 300 --auto-rollback on --spike-at 200
  ckptkit train: spike at step 200 (...): update discarded; re-running step 200 from the state before it
  ckptkit train: ROLLED BACK to step 190 (rollback 1, 1 in a row): lr 0.00295 -> 0.00147 (x0.5 from now on); ...

data parallel under torchrun (spec/trainer.md R-T14): DDP by default, --parallel fsdp for FSDP2;
--batch is the global batch (a multiple of the world size); rank 0 writes history.jsonl and the log:
  $ torchrun --nproc_per_node 2 -m ckptkit train --run-dir runs/d --steps 40 --ckpt-every 10
  $ torchrun --nproc_per_node 2 -m ckptkit train --run-dir runs/d --steps 80 --ckpt-every 10 --resume

Ctrl-C (SIGINT) or SIGTERM: the step in progress finishes and is saved, and the command to
resume is printed (exit 75); a second Ctrl-C aborts at once, leaving every checkpoint intact:
  ckptkit train: stopped at step 57 (SIGINT): saved runs/a/step-00000057.ckpt
  resume with: ckptkit train --run-dir runs/a --steps 100 --quant int8 --resume

exit codes: 0 trained, 1 resume refused (config drift, environment drift, stream offset,
legacy checkpoint), a corrupt file, or no consistent checkpoint to resume from (each one
damaged or unreadable, listed), 2 usage error or unreadable path, 3 training unstable
(--auto-rollback on: --rollback-bound consecutive spikes, or more than --rollback-cap rollbacks),
75 stopped on request (SIGINT, SIGTERM, CKPTKIT_STOP_AT): resumable
"""


def add_knobs(p: argparse.ArgumentParser, shown: Mapping[str, Any] | None = None) -> None:
    """The trainer's flags, one per config key; ``shown``: the default a command uses instead of
    the config's for some keys (``ckptkit audit``'s), as its ``--help`` states it."""
    # Imported here: `ckptkit verify` builds every subparser's flags only when
    # its command is chosen, but keep the trainer's import cost out of the rest.
    from ..trainer._config import TrainerConfig, flag_name, help_text, knobs

    defaults, shown = TrainerConfig(), shown or {}
    groups: dict[str, Any] = {}
    titles = {
        "model": "model",
        "data": "data",
        "train": "training",
        "testing": "testing aids (faults planted on purpose: the tests and the audit use them)",
        "monitor": "spike monitor (see --auto-rollback)",
    }
    for key, f in knobs():
        table = key.partition(".")[0]
        group = groups.setdefault(table, p.add_argument_group(titles[table]))
        default = getattr(getattr(defaults, table), f.name)
        flag = flag_name(key, f)
        said = str(shown[key]) if key in shown else repr(default.value if isinstance(default, enum.Enum) else default)
        text = f"{help_text(key, f)} (default: {said}; config key {key})".replace("%", "%%")
        kind = type(default) if default is not None else int  # the Optional knobs are ints
        if kind is bool:
            group.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif isinstance(default, enum.Enum):  # --auto-rollback, --rollback-skip
            group.add_argument(flag, dest=key, choices=[m.value for m in type(default)], default=None, help=text)
        elif key == "model.quant":
            group.add_argument(flag, dest=key, choices=("none", "int8"), default=None, help=text)
        else:
            group.add_argument(flag, dest=key, type=kind, default=None, metavar=f.name.upper(), help=text)


def add_parser(sub: Any) -> None:
    """``ckptkit train``'s flags, kept as one function: a flag table reads best as one list, in ``--help`` order."""
    p = sub.add_parser(
        "train",
        help="train the reference byte-level GPT (resumable, bit-exact)",
        description="Train a tiny byte-level GPT whose resume is the same run, or a hard error.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run_group = p.add_argument_group("run")
    run_group.add_argument("--run-dir", required=True, metavar="DIR", help="the run directory")
    run_group.add_argument(
        "--resume", action="store_true", help="continue from the newest consistent checkpoint in --run-dir"
    )
    run_group.add_argument(
        "--reshard",
        action="store_true",
        help="with --resume: continue a run saved at another world size or layout (DCP reshards the model "
        "and optimizer; the history records that the run is no longer bit-comparable to its past)",
    )
    run_group.add_argument(
        "--allow-legacy",
        action="store_true",
        help="accept a v1 checkpoint that lacks state (recorded in history.jsonl)",
    )
    run_group.add_argument(
        "--allow-env-change", action="store_true", help="accept a different environment (recorded in history.jsonl)"
    )
    run_group.add_argument(
        "--resume-check",
        choices=("error", "warn", "off"),
        default=None,
        help="with --resume: the steps the interrupted run recorded after the checkpoint are re-run and "
        "compared bit for bit; a difference stops the run (error, the default), is said (warn), or nothing "
        "is compared (off) (spec/determinism.md R-D24)",
    )
    run_group.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch intra-op threads (default: torch's own, e.g. from OMP_NUM_THREADS). "
        "Recorded with the run (environment.json): a resume under another count is "
        "refused unless --allow-env-change; the summary's extend command repeats it",
    )
    run_group.add_argument(
        "--dist-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="under torchrun: how long a collective waits for a peer before the job fails, so a dead "
        "rank ends the job instead of hanging it (default: 60)",
    )
    run_group.add_argument(
        "--single-writer-store",
        action="store_true",
        help="on s3://: do not check that the store enforces conditional writes (If-None-Match), because "
        "you vouch that one job at a time writes there; recorded in history.jsonl (the same as "
        "CKPTKIT_SINGLE_WRITER_STORE=1; spec/objectstore.md R-O49)",
    )
    run_group.add_argument(
        "--quiet", action="store_true", help="no progress bar and no log lines on stderr (the summary still prints)"
    )
    run_group.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_knobs(p)


def config_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~ckptkit.trainer.TrainerConfig` the flags ask for (defaults elsewhere);
    the testing aids' flags (``--spike-at``, ``--perturb-at``, ...) fill its ``testing`` table.

    Raises:
        ValueError: a value breaks a field's rule (the message names the flag).
    """
    from ..trainer._config import TrainerConfig, knobs

    given = {key: getattr(args, key) for key, _ in knobs() if getattr(args, key, None) is not None}
    return TrainerConfig().replace(**given)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"ckptkit train: {e}", file=sys.stderr)
        return 2
    problem = _usage_problem(args, cfg)
    if problem is not None:
        print(f"ckptkit train: {problem}", file=sys.stderr)
        return 2

    from ..trainer._parallel import DEFAULT_TIMEOUT_S, check_fits, process_group

    # Under torchrun: join the job (a bounded timeout: a dead rank ends it); rank 0 prints.
    with process_group(args.dist_timeout or DEFAULT_TIMEOUT_S) as where:
        try:
            check_fits(cfg, where)
        except ValueError as e:
            print(f"ckptkit train: {e}", file=sys.stderr)
            return 2
        speak = where.rank == 0  # rank 0 speaks for the job; the others train silently
        with contextlib.nullcontext() if speak else contextlib.redirect_stdout(io.StringIO()), _vouched(args):
            return _train(args, cfg, speak)


@contextlib.contextmanager
def _vouched(args: argparse.Namespace) -> Iterator[None]:
    """``--single-writer-store``: :data:`~ckptkit.format._objectstore.SINGLE_WRITER_ENV` set for the call."""
    from ..format._objectstore import SINGLE_WRITER_ENV

    before = os.environ.get(SINGLE_WRITER_ENV)
    if args.single_writer_store:
        os.environ[SINGLE_WRITER_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SINGLE_WRITER_ENV, None)
        else:
            os.environ[SINGLE_WRITER_ENV] = before


def _train(args: argparse.Namespace, cfg: Any, speak: bool) -> int:
    from torch import get_num_threads as torch_threads

    from ..run._files import SET_ASIDE, is_fallback_note
    from ..run._lease import TAKEOVER
    from ..run._preemption import RunStopped
    from ..run._resume_check import is_verdict
    from ..trainer._loop import intra_op_threads, train
    from ._progress import Progress

    began = time.monotonic()
    try:
        with Progress("train", quiet=args.quiet or not speak) as progress:

            def on_step(result: Any) -> None:
                progress.at(result.step + 1, cfg.train.steps, loss=f"{result.loss:.4f}")

            # The count is an environment fact of the run: a resume under another one is
            # refused by the environment check (or recorded with --allow-env-change).
            with intra_op_threads(args.threads):
                threads = torch_threads()
                result = train(
                    cfg,
                    args.run_dir,
                    resume=args.resume,
                    reshard=args.reshard,
                    allow_legacy=args.allow_legacy,
                    allow_env_change=args.allow_env_change,
                    resume_check=args.resume_check,
                    log=lambda line: progress.log(
                        line,
                        always=is_fallback_note(line) or is_verdict(line) or line.startswith((TAKEOVER, SET_ASIDE)),
                    ),
                    on_step=on_step,
                    preemptible=True,
                )
    except RunStopped as stop:  # Ctrl-C / SIGTERM: the step in progress was saved (after the bar closed)
        if speak:
            _print_stop(args, cfg, stop, threads, seconds=time.monotonic() - began)
        return stop.code  # type: ignore[return-value]
    _print_result(args, cfg, result, threads, seconds=time.monotonic() - began)
    return 0


def _print_stop(args: argparse.Namespace, cfg: Any, stop: Any, threads: int, *, seconds: float) -> None:
    """After a stop: on stderr what was saved and the resume command; on stdout the summary (R-T15)."""
    from ._width import fit, fit_command, terminal_width

    width = terminal_width(sys.stderr)
    lines = fit(f"ckptkit train: stopped at step {stop.step} ({stop.reason}): saved {stop.path}", width, 15)
    lines += fit_command("resume with: ", _resume_command(args, cfg), width, 2)
    print("\n".join(lines), file=sys.stderr, flush=True)
    if not args.json:
        summary = _summary(args, cfg, stop.step, threads, seconds, resume=True)
        print("\n".join(summary.lines(terminal_width(sys.stdout))), flush=True)


def _usage_problem(args: argparse.Namespace, cfg: Any) -> str | None:
    """What is wrong with the flags beyond each field's own rule (exit 2), or None."""
    if cfg.data.path and not os.path.isfile(cfg.data.path):
        return f"--data {cfg.data.path}: no such file"
    if args.threads is not None and args.threads < 1:
        return f"--threads must be >= 1 (got {args.threads})"
    if args.reshard and not args.resume:
        return "--reshard needs --resume (it changes how a saved run is continued)"
    if args.dist_timeout is not None and not args.dist_timeout > 0:
        return f"--dist-timeout must be > 0 seconds (got {args.dist_timeout})"
    return None


def _print_result(args: argparse.Namespace, cfg: Any, result: Any, threads: int, *, seconds: float) -> None:
    """stdout after a finished run: the ``--json`` object, or the last checkpoint and the summary."""
    if args.json:
        print(
            json.dumps(
                {
                    "schema_version": 1,
                    "step": result.step,
                    "checkpoint": result.checkpoint,
                    "history": result.history,
                    "fp32_latched": result.fp32_latched,
                    "spikes": result.report["spikes"],
                    "rollback": result.rollback,
                    "resume_notes": list(result.resume_notes),
                },
                sort_keys=True,
            )
        )
    else:
        from ._width import terminal_width

        print(f"step {result.step}: {result.checkpoint or '(no new checkpoint)'}")
        print("\n".join(_summary(args, cfg, result.step, threads, seconds).lines(terminal_width(sys.stdout))))


def _summary(
    args: argparse.Namespace, cfg: Any, step: int, threads: int, seconds: float, *, resume: bool = False
) -> Any:
    """The end-of-run summary, read back from the run directory (``_summary``).

    Its extend command repeats what this call ran under: every config flag that
    differs from its default, the thread count, and --allow-env-change and
    --single-writer-store if given.
    ``resume``: the run was stopped; the last row is the command that resumes it.
    """
    from ..trainer._audit import knob_flags
    from ._summary import extend_command, summarize

    default_steps = type(cfg.train)().steps  # --steps is spelled out in the command, whatever its value
    flags = [*knob_flags(cfg.replace(**{"train.steps": default_steps})), "--threads", str(threads)]
    if args.allow_env_change:  # environment.json keeps the facts the run started with
        flags.append("--allow-env-change")
    if args.single_writer_store:  # the store is still the one the user vouched for
        flags.append("--single-writer-store")
    if resume:
        return summarize(
            args.run_dir, seconds=seconds, keep=cfg.train.keep, extend=_resume_command(args, cfg), next_step="resume"
        )
    extend = extend_command(args.run_dir, max(2 * step, step + 1), flags, _launcher())
    return summarize(args.run_dir, seconds=seconds, keep=cfg.train.keep, extend=extend)


def _resume_command(args: argparse.Namespace, cfg: Any) -> str:
    """The ``ckptkit train`` line that continues this run: the same knobs, ``--resume``."""
    import shlex

    from ..trainer._audit import knob_flags

    repeated = ("--allow-legacy", "--allow-env-change", "--single-writer-store")
    flags = [f for f in repeated if getattr(args, f[2:].replace("-", "_"))]
    if args.threads is not None:  # the thread count is an environment fact of the run
        flags += ["--threads", str(args.threads)]
    if args.resume_check is not None:
        flags += ["--resume-check", args.resume_check]
    return shlex.join([*_launcher(), "train", "--run-dir", str(args.run_dir), *knob_flags(cfg), *flags, "--resume"])


def _launcher() -> list[str]:
    """How this run was started: ``ckptkit``, ``torchrun --nproc_per_node W -m ckptkit`` on one
    node, or on several (torchrun's ``LOCAL_WORLD_SIZE`` below the world size) the command each
    node runs, with the rendezvous endpoint to fill in (torchrun does not tell its ranks it)."""
    from ..trainer._parallel import ranks

    world = ranks().world
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if world == 1:
        return ["ckptkit"]
    if not 0 < per_node < world or world % per_node:
        return ["torchrun", "--nproc_per_node", str(world), "-m", "ckptkit"]
    nodes = ["--nnodes", str(world // per_node), "--nproc_per_node", str(per_node)]
    return ["torchrun", *nodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", "HOST:PORT", "-m", "ckptkit"]
