"""The reference trainer's fingerprints: what ``history.jsonl`` records so a replay can check it.

Implements ``spec/replay.md`` R-P01..R-P04 and the testing aid R-P10. Three records:

* every ``step`` row carries ``params_digest``: :func:`ckptkit.run.combine`
  of the per-parameter digests after the step (equal to ``state_digest`` over the
  model's named parameters);
* after every step a ``digests`` row holds those per-parameter digests by name, so a
  divergence can be traced to the parameter that changed first;
* before every checkpoint a ``checkpoint`` row holds the digest of every leaf of the
  checkpoint (parameters, optimizer state, teacher, monitor, header), so a replay can
  check the file it starts from and name any tensor altered after the fact.

Names are those of :func:`ckptkit.format._tree.checkpoint_state` (``model:model.wte``,
``optim:optimizers.adamw.state.3.exp_avg``), so ``ckptkit diff --tensors`` and
``ckptkit replay`` name the same tensors. A ``digests``/``checkpoint`` row's
``step`` is the number of steps done, like a checkpoint's and a ``resume`` row's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from ..run._fingerprint import checkpoint_digests, combine, tensor_digest
from ._parallel import full_tensor

__all__ = [
    "MODEL_PREFIX",
    "checkpoint_row",
    "param_digests",
    "params_digest",
    "perturb",
    "perturb_target",
]

#: How the checkpoint names the student's tensors: section ``model``, entry ``model``
#: (``RunState.add_model("model", ...)``), then the module's own name.
MODEL_PREFIX = "model:model."


def param_digests(model: torch.nn.Module) -> dict[str, int]:
    """Per-parameter digests, named as the checkpoint names them (``model:model.wte``).

    Of the whole parameters: an FSDP2 shard is gathered first (a collective: every rank calls this).
    """
    return {
        MODEL_PREFIX + name: tensor_digest(MODEL_PREFIX + name, full_tensor(p)) for name, p in model.named_parameters()
    }


def params_digest(digests: Mapping[str, int]) -> int:
    """The order-independent ``params_digest`` of a step row (spec/replay.md R-P01)."""
    return combine(digests.values())


def checkpoint_row(rs: Any, step: int) -> dict[str, Any]:
    """The ``checkpoint`` row written before ``rs`` saves ``step``: every leaf's digest.

    Under torchrun (a run state of several ranks) it names the checkpoint directory only:
    each rank holds a part of the state, and the directory's own digests cover every chunk
    (spec/trainer.md R-T14).
    """
    file = os.path.basename(rs.checkpoint_path(step))
    tensors = {} if rs.world_size > 1 else checkpoint_digests(rs.checkpoint(step))
    return {"kind": "checkpoint", "step": step, "file": file, "tensors": tensors}


def perturb_target(cfg: Any, model: torch.nn.Module) -> str | None:
    """The parameter ``--perturb-at`` changes (its model name), or None when the aid is off.

    Raises:
        ValueError: ``--perturb-param`` names no parameter of the model (the message lists them).
    """
    if cfg.testing.perturb_at is None:
        return None
    names = [n for n, _ in model.named_parameters()]
    want: str = cfg.testing.perturb_param
    if want.startswith(MODEL_PREFIX):
        want = want[len(MODEL_PREFIX) :]
    if not want:
        return names[0]
    if want not in names:
        raise ValueError(
            f"--perturb-param {cfg.testing.perturb_param!r} is not a parameter of the model "
            f"(parameters: {', '.join(names)})"
        )
    return want


@torch.no_grad()
def perturb(run: Any, step: int) -> None:
    """TESTING AIDS: at the end of step ``--perturb-at``, element 0 of the target parameter moves
    to the next float up (1 ulp), so exactly one tensor differs there; from step
    ``--global-draw-from`` on, it moves by a draw from the global RNG, which no checkpoint
    restores: a process that resumes draws other numbers (spec/determinism.md R-D25)."""
    cfg = run.cfg
    drawn = cfg.testing.global_draw_from is not None and step >= cfg.testing.global_draw_from
    if drawn:
        first = next(iter(run.model.parameters()))
        getattr(first, "to_local", lambda: first)().view(-1)[0] += torch.rand(()).item() * 1e-3
    if cfg.testing.perturb_at != step:
        return
    name = perturb_target(cfg, run.model)
    p = dict(run.model.named_parameters())[name]
    local = getattr(p, "to_local", lambda: p)()  # an FSDP2 shard: element 0 is in rank 0's (dim-0 sharding)
    if local is p or run.ranks.rank == 0:
        flat = local.view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=p.dtype))
