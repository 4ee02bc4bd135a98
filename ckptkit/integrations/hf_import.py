"""Import a ``checkpoint-N/`` folder that transformers' own ``Trainer`` wrote, once, unpickling nothing.

    from ckptkit.integrations.hf_import import import_trainer_folder

    old = import_trainer_folder("out/checkpoint-500")
    model.load_state_dict(old.model, strict=False)   # tied weights (lm_head.weight) are stored once
    optimizer.load_state_dict(old.optimizer)
    scheduler.load_state_dict(old.scheduler)
    state.save(old.step)                             # the run's first checkpoint, with its companions

What is read, and how (spec/transformers.md R-HF06): the weights from safetensors
(``model.safetensors``, or the shards of ``model.safetensors.index.json``; needs the
``safetensors`` package: ``pip install 'ckptkit[safetensors]'``), ``optimizer.pt``,
``scheduler.pt`` and ``scaler.pt`` with :func:`ckptkit.import_torch_checkpoint`
(``torch.load(weights_only=True)``: tensors and plain containers only), the step from
``trainer_state.json``. ``rng_state.pth`` and ``training_args.bin`` are pickles of Python
objects (numpy's RNG state, ``TrainingArguments``): they are not read, and
:attr:`TrainerImport.not_imported` says so. A folder ckptkit's own ``Trainer`` committed
is refused: resume it with that ``Trainer``.

The import starts a new ckptkit run from the folder's state; what the folder never held
as plain data (the RNG states, the data position) is the new run's to define
(docs/integrations.md "Hugging Face").
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from ..errors import CheckpointNotFound, FormatError, UnsupportedValue
from ..format._checkpoint import import_torch_checkpoint
from ..format._checks import is_int
from .hf_folder import STATE_FILE, folder_step

__all__ = ["TrainerImport", "import_trainer_folder"]

_WEIGHTS = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_TORCH_STATE = {"optimizer": "optimizer.pt", "scheduler": "scheduler.pt", "scaler": "scaler.pt"}
#: Files of a Trainer folder that are pickles of Python objects: never read.
PICKLED = {
    "rng_state.pth": "a pickle of Python and numpy RNG objects; the new run seeds its own RNG",
    "training_args.bin": "a pickled TrainingArguments; give the new run its config (RunState(config=...))",
}


@dataclasses.dataclass(frozen=True)
class TrainerImport:
    """What an imported ``checkpoint-N/`` folder held, as tensors and plain containers.

    Attributes:
        folder: the folder read.
        step: ``trainer_state.json``'s ``global_step`` (the optimizer steps taken).
        model: the weights by parameter name, as safetensors stores them: a weight tied
            to another (GPT-2's ``lm_head.weight``) is stored once, so load them with
            ``strict=False`` and check that only tied names are missing.
        optimizer / scheduler / scaler: their ``state_dict()``s, None when the file is absent.
        trainer_state: ``trainer_state.json`` as JSON (the log history included).
        not_imported: ``file -> why`` for the folder's pickles, which are not read.
    """

    folder: str
    step: int
    model: dict[str, Any]
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None
    trainer_state: dict[str, Any]
    not_imported: dict[str, str]


def import_trainer_folder(folder: str | os.PathLike[str]) -> TrainerImport:
    """Read a transformers ``Trainer`` checkpoint folder without unpickling anything.

    Raises:
        CheckpointNotFound: no such folder, or no weights in it.
        FormatError: ``trainer_state.json`` or the shard index is not the JSON Trainer writes.
        UnsupportedValue: ckptkit's own ``Trainer`` committed the folder (resume it with
            that), or a ``.pt`` file holds more than tensors and plain containers.
        ModuleNotFoundError: ``safetensors`` is not installed (naming the extra).
    """
    path = os.fspath(folder)
    if not os.path.isdir(path):
        raise CheckpointNotFound(f"{path}: no such checkpoint folder")
    if os.path.exists(os.path.join(path, STATE_FILE)):
        raise UnsupportedValue(
            f"{path}: committed by ckptkit's Trainer ({STATE_FILE}); resume it with "
            "ckptkit.integrations.transformers.Trainer(...).train(resume_from_checkpoint=True), not an import"
        )
    state = _json(os.path.join(path, "trainer_state.json"))
    step = state.get("global_step", folder_step(path))
    if not is_int(step):
        raise FormatError("global_step is not a step count", path=os.path.join(path, "trainer_state.json"), actual=step)
    parts = {
        name: import_torch_checkpoint(os.path.join(path, file)) if os.path.exists(os.path.join(path, file)) else None
        for name, file in _TORCH_STATE.items()
    }
    return TrainerImport(
        folder=path,
        step=step,
        model=_weights(path),
        trainer_state=state,
        not_imported={f: why for f, why in PICKLED.items() if os.path.exists(os.path.join(path, f))},
        **parts,
    )


def _json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise CheckpointNotFound(f"{path}: missing; not a Trainer checkpoint folder") from None
    except (OSError, ValueError) as e:
        raise FormatError(f"not readable JSON ({e})", path=path) from None
    if not isinstance(doc, dict):
        raise FormatError("not a JSON object", path=path, actual=type(doc).__name__)
    return doc


def _weights(folder: str) -> dict[str, Any]:
    try:
        from safetensors.torch import load_file
    except ModuleNotFoundError as e:
        from ._extra import missing_extra

        raise missing_extra(e, __name__, "safetensors", "safetensors") from None
    single = os.path.join(folder, _WEIGHTS)
    if os.path.exists(single):
        return dict(load_file(single))
    index = os.path.join(folder, _INDEX)
    if not os.path.exists(index):
        raise CheckpointNotFound(
            f"{folder}: no {_WEIGHTS} and no {_INDEX}; a folder saved with safetensors is imported "
            "(save_safetensors=True, Trainer's default)"
        )
    weight_map = _json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise FormatError("weight_map is missing or not a map of file names", path=index)
    out: dict[str, Any] = {}
    for shard in sorted(set(weight_map.values())):
        if os.path.basename(shard) != shard:
            raise FormatError(f"shard {shard!r} is not a file name in the folder", path=index)
        out.update(load_file(os.path.join(folder, shard)))
    return out
