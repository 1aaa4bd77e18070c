"""The run context: what one run of a fairseq command uses, made once per task and passed on.

A fairseq command builds its task first (``tasks.setup_task``), then the model, the criterion
and, to train, the trainer; each is handed the task. :func:`run_context` makes the task's
:class:`RunContext` on first use: the run's :class:`~fairseq_fp16.precision.Precision`
(``--fp16``/``--bf16``/``--cpu`` and ``--loss-scale``, as the task's config has them), its
flags as a :class:`~fairseq_fp16.flags.PrecisionFlags`, and its :class:`RunRecord`
(``SAVE_DIR/run_info.json``). The features, the task patches, the trainer patch and the
optimizer wrapper take what they need from it. Nothing of a run lives in module state, so two
runs in one process never see each other's settings.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Optional

from .flags import PrecisionFlags, flag, task_config
from .precision import Precision

__all__ = ["RUN_INFO", "RunContext", "RunRecord", "run_context"]

#: the record's file name in the run's save directory
RUN_INFO = "run_info.json"
_ATTR = "_fairseq_fp16_context"


class RunRecord:
    """What a training run used, written for the comparison tools: ``SAVE_DIR/run_info.json``.

    The features record what they chose as they set up (and the first training step what it
    counted); the file is rewritten on each record, and exists from the start of training on
    rank 0 of runs that save checkpoints (the trainer patch gives it its path). Keys:

    ``precision``, ``device`` (``cpu``/``cuda``); ``half_matmul``: the CPU matrix-product path
    of a half run (e.g. ``"fp32 accumulation, rounded to half (--half-matmul auto)"``; None for
    fp32 or CUDA); ``native_half_products``: half products of the first training step that fp32
    accumulation left on native kernels (None: not checked); ``batch_lengths``: e.g. ``"padded
    to a multiple of 8 (--cpu-length-multiple auto)"`` (None: as they are); ``kernel_caches``;
    ``fused_loss``; ``attention``; ``compile_layers``; ``cpu_dropout``; ``compile_step``: whether
    the optimizer's update runs compiled from the half gradients (``--compile-step``, half runs).
    """

    def __init__(self) -> None:
        self._info: Dict[str, Any] = {}
        self.path: Optional[str] = None

    def record(self, **entries: Any) -> None:
        """Record ``entries`` (and write the file, once its path is set)."""
        self._info.update(entries)
        self._write()

    def set_path(self, path: Optional[str]) -> None:
        """Where the file goes (None: nowhere); writes what was recorded so far."""
        self.path = path
        self._write()

    def _write(self) -> None:
        if not self.path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self._info, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)


@dataclasses.dataclass
class RunContext:
    """One run's precision, flags and record.

    Attributes:
        precision: the run's precision and loss scaling.
        flags: the plugin's flags of the run, each field typed as :class:`PrecisionFlags`
            declares it (a configuration without one, a stock checkpoint's, gives its default).
        save_dir: ``--save-dir``; train_subset: ``--train-subset``.
        record: ``SAVE_DIR/run_info.json``.
    """

    precision: Precision
    flags: PrecisionFlags
    save_dir: str = "checkpoints"
    train_subset: str = "train"
    record: RunRecord = dataclasses.field(default_factory=RunRecord)

    @classmethod
    def from_config(cls, cfg) -> "RunContext":
        """From a task's config (a dataclass task's, whose fairseq values refer to the run's
        ``common`` group, or a legacy task's ``Namespace``)."""
        precision = Precision.from_flags(
            fp16=bool(flag(cfg, "fp16", False)), bf16=bool(flag(cfg, "bf16", False)),
            loss_scale=flag(cfg, "loss_scale"), cpu=bool(flag(cfg, "cpu", False)))
        defaults = PrecisionFlags()
        flags = PrecisionFlags(**{
            f.name: flag(cfg, f.name, getattr(defaults, f.name))
            for f in dataclasses.fields(PrecisionFlags) if f.name != "_name"})
        return cls(precision, flags, save_dir=str(flag(cfg, "save_dir", "checkpoints")),
                   train_subset=str(flag(cfg, "train_subset", "train")))


def run_context(task) -> RunContext:
    """``task``'s run context, made from its config on first use."""
    context = task.__dict__.get(_ATTR)
    if context is None:
        context = task.__dict__[_ATTR] = RunContext.from_config(task_config(task))
    return context
