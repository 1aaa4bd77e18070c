"""The run's precision, parsed once: fp32, fp16 or bf16 and how its loss is scaled.

:class:`Precision` is what the optimizer, the task-level features and the scripts ask instead
of reading ``--fp16``/``--bf16`` themselves::

    precision = Precision.from_cfg(cfg)          # fairseq's config (or its `common` group)
    precision.name, precision.dtype              # 'fp16', torch.float16
    precision.is_half                            # False for fp32: every feature passes through
    precision.loss_scale                         # LossScaleSpec(dynamic=True, scale=None)

fp32 is a precision like the others: its ``dtype`` is ``torch.float32``, ``is_half`` is False,
and the features built from it do nothing. A run's is kept in its run context
(:mod:`fairseq_fp16.context`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .core.loss_scaler import parse_loss_scale

__all__ = ["EXCLUSIVE", "NAMES", "LossScaleSpec", "Precision", "exclusive"]

NAMES = ("fp32", "fp16", "bf16")
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def exclusive(fp16: str = "--fp16", bf16: str = "--bf16") -> str:
    """The refusal of an fp16 flag given with a bf16 one."""
    return f"{fp16} and {bf16} are exclusive: pick one precision"


EXCLUSIVE = exclusive()


@dataclass(frozen=True)
class LossScaleSpec:
    """``--loss-scale``: dynamic (``scale`` = the initial one, fairseq's ``--fp16-init-scale``)
    or static (``scale`` fixed); ``None`` means no scaling (a static 1)."""

    dynamic: bool
    scale: Optional[float] = None

    def __str__(self) -> str:
        if self.dynamic:
            return "dynamic loss scale"
        return "no loss scaling" if self.scale in (None, 1.0) else f"static loss scale {self.scale:g}"


@dataclass(frozen=True)
class Precision:
    """A training precision: ``name`` in :data:`NAMES`, the loss scaling it uses, and whether
    the run is on the CPU."""

    name: str = "fp32"
    loss_scale: LossScaleSpec = LossScaleSpec(dynamic=False)
    cpu: bool = False

    def __post_init__(self):
        if self.name not in NAMES:
            raise ValueError(f"precision must be one of {', '.join(NAMES)}, got {self.name!r}")

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    @property
    def is_half(self) -> bool:
        return self.name != "fp32"

    @classmethod
    def from_flags(cls, fp16: bool = False, bf16: bool = False, loss_scale: Any = None,
                   cpu: bool = False) -> "Precision":
        """From fairseq's ``--fp16``/``--bf16`` and the plugin's ``--loss-scale``.

        ``--loss-scale``: unset = dynamic for fp16, none for bf16 and fp32; ``0`` = dynamic; a
        positive power of two = static.

        Raises:
            ValueError: for ``--fp16`` with ``--bf16``, or a bad ``--loss-scale`` (naming it).
        """
        if fp16 and bf16:
            raise ValueError(EXCLUSIVE)
        name = "fp16" if fp16 else "bf16" if bf16 else "fp32"
        scale = parse_loss_scale(loss_scale)
        if scale is None:
            spec = LossScaleSpec(dynamic=name == "fp16")
        elif scale == 0.0:
            spec = LossScaleSpec(dynamic=True)
        else:
            spec = LossScaleSpec(dynamic=False, scale=scale)
        return cls(name, spec, bool(cpu))

    @classmethod
    def from_cfg(cls, cfg) -> "Precision":
        """From a fairseq config: the whole one (``cfg.common``, ``cfg.task.loss_scale``) or
        its ``common`` group alone."""
        common = getattr(cfg, "common", cfg)
        task = getattr(cfg, "task", None)
        return cls.from_flags(
            fp16=bool(getattr(common, "fp16", False)), bf16=bool(getattr(common, "bf16", False)),
            loss_scale=getattr(task, "loss_scale", None) if task is not None else None,
            cpu=bool(getattr(common, "cpu", False)),
        )

    @property
    def on_cpu(self) -> bool:
        """Whether the run computes on the CPU (``--cpu``, or no CUDA device)."""
        return self.cpu or not torch.cuda.is_available()

    def __str__(self) -> str:
        return self.name

