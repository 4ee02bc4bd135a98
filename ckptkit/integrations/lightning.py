"""Lightning's ``CheckpointIO`` plug-in: every Lightning checkpoint is a ckptkit container.

    from lightning.pytorch import Trainer
    from ckptkit.integrations.lightning import CheckpointIO

    trainer = Trainer(plugins=[CheckpointIO()])
    trainer.fit(model)                                  # checkpoints: no pickle, checksummed, atomic
    trainer.fit(model, ckpt_path="checkpoints/epoch=1-step=20.ckpt")   # every byte verified on load

Install with ``pip install 'ckptkit[lightning]'``. The plug-in implements Lightning's
extension point (``save_checkpoint``, ``load_checkpoint``, ``remove_checkpoint``, the
shape of ``TorchCheckpointIO``) and nothing beside it. Lightning's ``Fabric`` takes it
too (``Fabric(plugins=[CheckpointIO()])``).

Layout: the checkpoint dict Lightning builds is stored in a v2 container
(spec/container.md) as

* model section: ``{"state_dict": ...}`` (the LightningModule's weights);
* optim section: ``{"optimizer_states": [...], "lr_schedulers": [...]}`` (those present);
* monitor section: ``{"layout": "ckptkit.integrations.lightning/1", "checkpoint": {...}}``,
  every other top-level key (epoch, global_step, loops, callbacks, hyper_parameters,
  precision and datamodule state, what ``on_save_checkpoint`` added);
* the container's step: ``global_step`` (0 when absent, as in Fabric's checkpoints).

``load_checkpoint`` returns the same dict (dicts come back as plain dicts, keys in
sorted order; ordered dicts, such as the ``state_dict``, in their own order; tuples stay
tuples). So ``ckptkit verify`` and ``ckptkit inspect`` work
on these files as on any checkpoint, and ``ckptkit.load`` reads them without Lightning.

What the container carries besides tensors and plain values: the typed values of
spec/container.md §5.4 (numpy arrays and scalars such as ``np.random.get_state()``,
sets, ordered dicts, torch dtypes, devices and sizes), each back as the same type. What
it cannot carry -- e.g. a module or an object passed to ``save_hyperparameters``, an
Enum, omegaconf containers, a callback whose ``state_dict()`` returns an object -- is
refused with :class:`~ckptkit.errors.UnsupportedValue` naming the key path
(``checkpoint['hyper_parameters']['act']``) and what to do; nothing is written and a
previous file at the path is untouched. Passed in ``callbacks`` as well as ``plugins``,
the plug-in refuses hyper-parameters and callback state when ``fit`` starts, before
step 1 (spec/lightning.md R-L04), and keeps in each checkpoint what Lightning's resume
leaves out -- the global generators, a plain ``DataLoader``'s position and its shuffle's
generator -- so a run killed mid-epoch resumes bit for bit; a loader it cannot restore is
named before step 1 (R-L08, :mod:`._lightning_resume`); and it records the run's
``history.jsonl`` and ``environment.json`` beside the ``ModelCheckpoint``'s files for the
audit (R-L09, :mod:`._lightning_record`). No value is encoded lossily and none is pickled. The
``_metadata`` attribute of a state dict (module versions, which only old checkpoints of
a few modules consult) is not stored, as with ``ckptkit.save``.

Paths: local files, or ``s3://bucket/key`` (spec/objectstore.md R-O44): a checkpoint there
is the same container as an object, committed by its record and checked on every read;
``remove_checkpoint`` uncommits it record first. A name is written once there, so a
second save to one name (``save_last``'s ``last.ckpt``) is refused with ``CommitConflict``;
Lightning's own ``ModelCheckpoint(dirpath="s3://...")`` lists the folder through fsspec,
which needs ``s3fs``. Other fsspec URLs are refused by name.

Known limits: ``map_location`` is honoured when it
is a device or a device string, anything else loads on the CPU (Lightning moves the
state where it belongs when it restores it); ``weights_only`` is accepted and
irrelevant: nothing is unpickled, ever.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, TypeGuard

from ..errors import CommitConflict, FormatError, UnsupportedValue
from ..format._checkpoint import Checkpoint, load, save
from ..format._checks import is_int
from ..format._place import place_and_name, place_for
from ..format._section import check_plain
from ._extra import missing_extra
from ._lightning_record import Recorder
from ._lightning_resume import ResumeState
from .lightning_file import LAYOUT

if TYPE_CHECKING:
    import torch

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _LightningCheckpointIO
    from lightning.pytorch.callbacks import Callback as _Callback
except ModuleNotFoundError as e:  # tested in a process without lightning
    raise missing_extra(e, __name__, "lightning", "Lightning") from None

__all__ = ["LAYOUT", "CheckpointIO", "LoadsContainers", "from_container", "load_from_checkpoint", "to_container"]

_MODEL_KEYS = ("state_dict",)
_OPTIM_KEYS = ("optimizer_states", "lr_schedulers")
# What to do when a top-level key holds a value the container cannot carry.
_ADVICE = {
    "hyper_parameters": "exclude that argument with self.save_hyperparameters(ignore=[...]) and rebuild it in "
    "__init__, or pass a plain value (for omegaconf, OmegaConf.to_container(cfg, resolve=True))",
    "hparams_type": "omegaconf hyper-parameters are stored with their type; pass "
    "OmegaConf.to_container(cfg, resolve=True) to save_hyperparameters instead",
    "callbacks": "a callback's state_dict() must return plain values (tensors, numbers, strings, lists, dicts)",
}
_DEFAULT_ADVICE = "convert it to plain values in on_save_checkpoint (and back in on_load_checkpoint)"
# Said when a save refuses what the callback role would have refused before step 1.
_AT_FIT_START = (
    "to have this refused when fit starts, before step 1, pass the plug-in in callbacks too: "
    "io = CheckpointIO(); Trainer(plugins=[io], callbacks=[io])"
)


def _check(checkpoint: dict[str, Any]) -> None:
    """Refuse a checkpoint the container cannot carry, naming the Lightning key path."""
    import torch

    from ..format._codec import check_tensor

    def tensor(value: Any, at: str) -> Any:
        if isinstance(value, torch.Tensor):
            check_tensor(value, at)
            return value
        return NotImplemented

    if not isinstance(checkpoint, dict):
        raise UnsupportedValue(f"checkpoint: a {type(checkpoint).__name__}; Lightning checkpoints are dicts")
    for key, value in checkpoint.items():
        if not isinstance(key, str):
            raise UnsupportedValue(
                f"checkpoint: top-level key {key!r} is a {type(key).__name__}; "
                "only str keys are stored at the top level"
            )
        try:
            check_plain(value, f"checkpoint[{key!r}]", 1, on_leaf=tensor)
        except UnsupportedValue as e:
            raise UnsupportedValue(f"{e}; {_ADVICE.get(key, _DEFAULT_ADVICE)}") from None


def to_container(checkpoint: dict[str, Any]) -> Checkpoint:
    """The :class:`~ckptkit.Checkpoint` that stores a Lightning checkpoint dict (the layout above).

    Raises:
        UnsupportedValue: a value the container cannot carry, named by its key path.
    """
    _check(checkpoint)
    model = {k: checkpoint[k] for k in _MODEL_KEYS if k in checkpoint}
    optim = {k: checkpoint[k] for k in _OPTIM_KEYS if k in checkpoint}
    rest = {k: v for k, v in checkpoint.items() if k not in _MODEL_KEYS and k not in _OPTIM_KEYS}
    step = checkpoint.get("global_step", 0)
    if not is_int(step):
        step = 0
    return Checkpoint(
        step=step, model=model or None, optim=optim or None, monitor={"layout": LAYOUT, "checkpoint": rest}
    )


def from_container(ckpt: Checkpoint, path: str = "") -> dict[str, Any]:
    """The Lightning checkpoint dict stored in ``ckpt`` (the inverse of :func:`to_container`).

    Raises:
        FormatError: the container was not written by this plug-in (its monitor section
            lacks the layout, or names another), or its ``monitor.checkpoint`` is not a map.
    """
    monitor = ckpt.monitor
    layout = monitor.get("layout") if isinstance(monitor, dict) else None
    if layout == LAYOUT and not isinstance(monitor.get("checkpoint"), dict):
        raise FormatError(
            "the Lightning keys are missing or not a map",
            path=path or None,
            field="monitor.checkpoint",
            hint="the file was altered after it was written",
        )
    if layout != LAYOUT:
        raise FormatError(
            "not a Lightning checkpoint written by ckptkit.integrations.lightning.CheckpointIO",
            path=path or None,
            field="monitor.layout",
            expected=LAYOUT,
            actual=layout or "none",
            hint="load it with ckptkit.load(); a torch.save file is imported once with ckptkit.import_torch_checkpoint",
        )
    out = dict(monitor["checkpoint"])
    for section in (ckpt.model, ckpt.optim):
        if isinstance(section, dict):
            out.update(section)
    return out


def _path(path: str | os.PathLike[str]) -> str:
    """A local path, or an ``s3://`` URL (another scheme, or no S3 client, is refused by the place
    it names, R-O01, R-O02)."""
    name = os.fspath(path)
    place_for(name)
    return name


def _save(name: str, ckpt: Checkpoint, compression: str | dict[str, str], level: int) -> None:
    place_and_name(name)[0].make()  # Lightning's own CheckpointIO makes the folder too
    try:
        save(name, ckpt, compression=compression, level=level)
    except CommitConflict as e:  # a name on object storage is written once (R-O11, R-O44)
        raise CommitConflict(
            f"{e}; Lightning saves to a name once per checkpoint on s3:// (ModelCheckpoint(save_last=True) "
            "rewrites last.ckpt): use a filename with {step}, or save_last=False",
            path=e.filename,
        ) from None


def _remove(name: str) -> None:
    """Delete the checkpoint ``name`` from its place: a local file, or an object's record first, then
    its objects (R-O17); a missing one is fine."""
    place, base = place_and_name(name)
    place.remove(base, [name])


class CheckpointIO(_LightningCheckpointIO, _Callback):
    """Lightning ``CheckpointIO`` that writes and reads ckptkit containers.

    It is also a Lightning ``Callback``: passed in ``callbacks`` too, it checks when
    ``fit`` starts, before step 1, that the hyper-parameters (module and datamodule) and
    every callback's ``state_dict()`` can be stored, so a refusal does not wait for the
    first checkpoint, after training has started. Lightning gives a ``CheckpointIO`` no
    hook of its own at ``fit`` start, hence the second role. In that role it also saves and
    restores what Lightning's resume leaves out (spec/lightning.md R-L08).

    In the callback role it also records the run (R-L09): ``history.jsonl`` and
    ``environment.json`` in the folder the ``ModelCheckpoint`` writes to, so ``ckptkit audit``,
    ``replay``, ``plot`` and the self-checking resume serve the script.

    Args:
        compression: ``"raw"`` (default) or ``"zstd"``, or ``{section: codec}`` (see :func:`ckptkit.save`).
        level: the zstd level.
        record: in the callback role, write the run's history (default True; False writes nothing).
        digests_every: a ``digests`` row every this many optimizer steps; None (the default):
            after every step while the state is at most 64 MiB, else at each checkpoint (R-L10).
        resume_check: what a resume does when the steps it re-runs differ from the rows the
            interrupted process recorded (``"error"``, ``"warn"``, ``"off"``; default
            ``$CKPTKIT_RESUME_CHECK``, else ``"error"``: spec/determinism.md R-D24).

    Raises:
        UnsupportedOption: ``digests_every`` is not None or an int >= 1, or ``resume_check`` is
            not one of the three.

    Example::

        io = CheckpointIO()
        trainer = lightning.pytorch.Trainer(plugins=[io], callbacks=[io])
    """

    def __init__(
        self,
        compression: str | dict[str, str] = "raw",
        level: int = 3,
        *,
        record: bool = True,
        digests_every: int | None = None,
        resume_check: str | None = None,
    ) -> None:
        super().__init__()
        self.compression = compression
        self.level = level
        self._recorder = Recorder(digests_every, resume_check) if record else None  # the run's history (R-L09)
        self._fit_checked = False  # set by the callback role's setup: the refusal then came before step 1
        self._resume = ResumeState()  # the callback role's run state (R-L08)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically and durably, as a v2 container (on
        ``s3://``: an object committed by its record).

        Raises:
            UnsupportedValue: a value the container cannot carry (named by key path), or
                ``storage_options`` (nothing is written).
            UnsupportedOption: a URL of another scheme than ``s3://``.
            CommitConflict: on ``s3://``, a checkpoint is committed at ``path`` already.
            SaveFailed: the write failed; a previous file at ``path`` is intact.
        """
        if storage_options is not None:
            raise UnsupportedValue(
                f"storage_options are not supported by {type(self).__name__} "
                f"(got {storage_options!r}); pass compression= to the plug-in instead"
            )
        name = _path(path)
        try:
            ckpt = to_container(checkpoint)
        except UnsupportedValue as e:
            if self._fit_checked:
                raise
            raise UnsupportedValue(f"{e} ({_AT_FIT_START})") from None
        _save(name, ckpt, self.compression, self.level)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read and verify (every byte, against its checksum) the checkpoint at ``path``.

        Raises:
            CheckpointNotFound: no file at ``path`` (a ``FileNotFoundError``, as Lightning expects).
            FormatError: the bytes break a rule of spec/container.md (``ChecksumMismatch``, ...),
                or the file was not written by this plug-in.
        """
        name = _path(path)
        device = map_location if isinstance(map_location, str) or _is_device(map_location) else "cpu"
        return from_container(load(name, map_location=device), name)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """The callback hook: at ``fit`` start, refuse hyper-parameters and callback state that cannot be stored.

        Raises:
            UnsupportedValue: naming the key path as :meth:`save_checkpoint` would, before step 1.
        """
        if stage == "fit":
            _check(_fit_state(trainer, pl_module))
            self._fit_checked = True
            self._resume.setup(trainer)

    def state_dict(self) -> dict[str, Any]:
        """The callback role's state in each checkpoint: the global generators, the epoch's batches taken,
        the shuffles' generators (spec/lightning.md R-L08)."""
        return self._resume.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep a checkpoint's resume state; it is restored when training starts.

        Raises:
            FormatError: the state lacks one of its keys.
        """
        self._resume.load_state_dict(state_dict)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Before step 1: name the loaders that cannot resume exactly; on a resume, restore what Lightning
        leaves out (R-L08)."""
        self._resume.on_train_start(trainer)
        if self._recorder is not None:
            self._recorder.start(trainer)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """The learning rate the step uses, for its ``step`` row (R-L09)."""
        if self._recorder is not None:
            self._recorder.before_optimizer_step(optimizer)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """The step's rows once the optimizer has stepped (R-L09)."""
        if self._recorder is not None:
            self._recorder.batch_end(trainer, pl_module, outputs, batch)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Every row of the steps before a checkpoint is on disk before it (R-L09)."""
        if self._recorder is not None:
            self._recorder.saving(trainer, pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Close the history: a resume's verdict not yet written goes in (R-D23)."""
        if self._recorder is not None:
            self._recorder.close()

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """Keep the shuffles' generators as the epoch's order is about to be drawn."""
        self._resume.on_train_epoch_start()

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        """Both roles' teardown: ``CheckpointIO.teardown()`` and the callback's ``teardown(trainer, module, stage)``.

        Nothing to release.
        """

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path`` (Lightning's top-k retention); a missing file is fine."""
        _remove(_path(path))


def _fit_state(trainer: Any, pl_module: Any) -> dict[str, Any]:
    """The parts of the checkpoint Lightning will build that are known when ``fit`` starts."""
    state: dict[str, Any] = {}
    holders = (("hyper_parameters", pl_module), ("datamodule_hyper_parameters", trainer.datamodule))
    for key, holder in holders:
        hparams = getattr(holder, "hparams", None) if holder is not None else None
        if hparams:  # Lightning stores dict(hparams), or an omegaconf container as it is
            is_omegaconf = type(hparams).__module__.partition(".")[0] == "omegaconf"
            state[key] = hparams if is_omegaconf else dict(hparams)
    state["callbacks"] = {cb.state_key: cb.state_dict() for cb in trainer.callbacks}
    return state


def _is_device(value: Any) -> TypeGuard[torch.device]:
    import torch

    return isinstance(value, torch.device)


def load_from_checkpoint(
    cls: type[Any],
    checkpoint_path: str | os.PathLike[str],
    map_location: Any | None = None,
    strict: bool | None = None,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(path)`` for a file the plug-in wrote: verified, never unpickled.

    Lightning's own ``load_from_checkpoint`` reads with ``torch.load`` whatever the
    trainer's plug-in, so on a ckptkit container it fails with torch's "Unsupported
    operand" (and its advice, ``weights_only=False``, would not help: the file is no
    pickle). This reads through :class:`CheckpointIO` (every digest checked), then builds
    the module as Lightning does: Lightning's checkpoint migration, the saved
    hyper-parameters updated with ``kwargs``, ``cls(**hparams)``, ``on_load_checkpoint``,
    ``load_state_dict(strict=strict)``, and the module moved to the weights' device.

    Args:
        cls: the ``LightningModule`` (or ``LightningDataModule``) class.
        map_location: a device or device string (anything else: the CPU).
        kwargs: hyper-parameters that override the saved ones.

    Raises:
        CheckpointNotFound: no file at the path.
        FormatError: damaged bytes, or a file this plug-in did not write (a ``torch.save``
            checkpoint: import it once with ``ckptkit.import_torch_checkpoint``).
    """
    from lightning.pytorch.core.saving import _load_state
    from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint

    name = _path(checkpoint_path)
    checkpoint = CheckpointIO().load_checkpoint(name, map_location=map_location)
    checkpoint = _pl_migrate_checkpoint(checkpoint, checkpoint_path=name)
    hparams = checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    hparams.update(kwargs)
    obj = _load_state(cls, checkpoint, strict=strict, **kwargs)
    weights = checkpoint.get("state_dict") or {}
    device = next((t.device for t in weights.values() if hasattr(t, "device")), None)
    return obj if device is None or not hasattr(obj, "to") else obj.to(device)


def _load_classmethod(
    cls: type[Any],
    /,
    checkpoint_path: str | os.PathLike[str],
    map_location: Any | None = None,
    hparams_file: Any | None = None,
    strict: bool | None = None,
    weights_only: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Build the module from a plug-in checkpoint (:func:`load_from_checkpoint`).

    Raises:
        UnsupportedValue: ``hparams_file`` was given.
    """
    if hparams_file is not None:
        raise UnsupportedValue(
            f"hparams_file={hparams_file!r}: not read by {cls.__name__}.load_from_checkpoint (a YAML file is "
            "not verified with the checkpoint); pass the hyper-parameters to override as keyword arguments"
        )
    return load_from_checkpoint(cls, checkpoint_path, map_location, strict, **kwargs)


class LoadsContainers:
    """Mix in before ``LightningModule`` so ``Module.load_from_checkpoint(path)`` reads plug-in files.

    Example::

        class Net(LoadsContainers, lightning.pytorch.LightningModule): ...

        net = Net.load_from_checkpoint("checkpoints/epoch=1-step=20.ckpt")  # verified, never unpickled

    It replaces Lightning's classmethod with :func:`load_from_checkpoint`: the same
    arguments, less ``hparams_file`` (pass overrides as keyword arguments) and
    ``weights_only`` (nothing is unpickled). A ``torch.save`` file is refused, not read.
    """

    # Typed Any: Lightning's is a restricted classmethod descriptor, which a type checker
    # would otherwise call incompatible with this one in the user's class.
    load_from_checkpoint: Any = classmethod(_load_classmethod)
