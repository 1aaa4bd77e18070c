"""The plugin's single seam into fairseq's trainer.

:func:`install` (run when the plugin is imported; idempotent) replaces three
methods of ``fairseq.trainer.Trainer``, keeping the originals:

``__init__``
    With ``--bf16``, fairseq's option parsing sets ``--tpu`` as well
    (``options.parse_args_and_arch``: "bf16 implies tpu"), which sends the run
    down the XLA path. The plugin trains bf16 on the selected device instead:
    the implied ``tpu`` is cleared unless ``--tpu`` was on the command line.

``_build_optimizer``
    Builds :class:`~fairseq_fp16.optim.mixed_precision.MixedPrecisionFairseqOptimizer`
    (fp32 master weights and the loss scaler under ``--fp16``/``--bf16``, a
    pass-through in fp32) instead of fairseq's ``FP16Optimizer``, which calls
    ``torch.cuda.current_device()`` and fails off CUDA. Parameters are tagged
    with their names first. Set-ups the wrapper does not cover
    (``--ddp-backend fully_sharded``, ``--memory-efficient-fp16/bf16``,
    ``--amp``, ``--use-bmuf``, ``--zero-sharding os``) use fairseq's original.

``train_step``
    fairseq's overflow handler ends with ``torch.tensor(0.0).cuda()``, which
    fails off CUDA. When our optimizer reported the overflow and the trainer
    is not on CUDA, that error is caught and the handler's remaining work
    (zero the gradients, log the scale, stop the ``train_wall`` timer) is
    done here; the update is skipped exactly as on a GPU.

:func:`check_fairseq_internals` checks the statements of fairseq's source
these replacements rely on; :func:`install` calls it and fails loudly if
fairseq changed.
"""

from __future__ import annotations

import inspect
import logging
import sys
from itertools import chain
from typing import Callable, Dict

from fairseq import trainer as fairseq_trainer
from fairseq.logging import metrics
from fairseq.optim import lr_scheduler

from .core.master_weights import tag_param_names
from .optim.mixed_precision import MixedPrecisionFairseqOptimizer, precision_of

logger = logging.getLogger(__name__)

__all__ = ["install", "uninstall", "is_installed", "check_fairseq_internals"]

_ORIGINALS: Dict[str, Callable] = {}
_MARK = "_fairseq_fp16_hook"

#: Statements of fairseq 0.12's trainer that the replacements depend on.
EXPECTED_SOURCE = {
    "__init__": ["self.tpu = cfg.common.tpu", "self._model = self._model.half()"],
    "_build_optimizer": [
        "optim.FP16Optimizer.build_optimizer(self.cfg, params)",
        "self._lr_scheduler = lr_scheduler.build_lr_scheduler(",
        "self._lr_scheduler.step_update(0)",
    ],
    "train_step": [
        "except OverflowError as e:",
        "grad_norm = torch.tensor(0.0).cuda()",
        'metrics.log_stop_time("train_wall")',
        "self.optimizer.scaler.loss_scale",
    ],
    "state_dict": ['"optimizer_name": self.optimizer.__class__.__name__'],
}


def check_fairseq_internals(trainer_cls=None) -> None:
    """Raise ``RuntimeError`` if fairseq's Trainer is not what the hook expects."""
    cls = trainer_cls or fairseq_trainer.Trainer
    for name, needles in EXPECTED_SOURCE.items():
        fn = _ORIGINALS.get(name) or getattr(cls, name, None)
        if fn is None:
            raise RuntimeError(f"fairseq_fp16: fairseq.trainer.Trainer has no {name}()")
        src = inspect.getsource(inspect.unwrap(fn))
        for needle in needles:
            if needle not in src:
                raise RuntimeError(
                    f"fairseq_fp16: fairseq.trainer.Trainer.{name} changed "
                    f"({needle!r} not found); this plugin supports fairseq 0.12"
                )


def _plugin_optimizer_applies(cfg) -> bool:
    dt = cfg.distributed_training
    return not (
        dt.ddp_backend == "fully_sharded"
        or cfg.common.memory_efficient_fp16
        or cfg.common.memory_efficient_bf16
        or cfg.common.amp
        or cfg.optimization.use_bmuf
        or dt.zero_sharding != "none"
    )


def _tpu_requested() -> bool:
    return any(a == "--tpu" for a in sys.argv[1:])


def _init(self, cfg, task, model, criterion, quantizer=None):
    common = getattr(cfg, "common", None)
    if common is not None and common.bf16 and common.tpu and not _tpu_requested():
        logger.info("fairseq_fp16: --bf16 on %s, not on TPU (pass --tpu for XLA)",
                    "CPU" if common.cpu else "the default device")
        common.tpu = False
    _ORIGINALS["__init__"](self, cfg, task, model, criterion, quantizer)


def _build_optimizer(self):
    if not _plugin_optimizer_applies(self.cfg):
        logger.info("fairseq_fp16: this set-up uses fairseq's own optimizer wrapper")
        return _ORIGINALS["_build_optimizer"](self)
    named = [
        (n, p)
        for n, p in chain(self.model.named_parameters(), self.criterion.named_parameters())
        if p.requires_grad
    ]
    tag_param_names(named)
    self._optimizer = MixedPrecisionFairseqOptimizer(
        self.cfg, [p for _, p in named], precision_of(self.cfg)
    )
    self._lr_scheduler = lr_scheduler.build_lr_scheduler(self.cfg.lr_scheduler, self.optimizer)
    self._lr_scheduler.step_update(0)


def _train_step(self, samples, raise_oom=False):
    try:
        return _ORIGINALS["train_step"](self, samples, raise_oom)
    except (AssertionError, RuntimeError):
        opt = self._optimizer
        if self.cuda or not getattr(opt, "overflow_pending", False):
            raise
    # fairseq's OverflowError handler failed at torch.tensor(0.0).cuda();
    # finish it as it would have on a GPU.
    with metrics.aggregate("train"):
        self.zero_grad()
        if self.cfg.common.fp16:
            metrics.log_scalar(
                "loss_scale", self.optimizer.scaler.loss_scale, priority=700, round=4, weight=0
            )
        metrics.log_stop_time("train_wall")
    return None


_REPLACEMENTS = {"__init__": _init, "_build_optimizer": _build_optimizer, "train_step": _train_step}


def is_installed() -> bool:
    return bool(getattr(fairseq_trainer.Trainer, _MARK, False))


def install() -> None:
    """Replace the Trainer methods above (idempotent)."""
    cls = fairseq_trainer.Trainer
    if is_installed():
        return
    check_fairseq_internals(cls)
    for name, fn in _REPLACEMENTS.items():
        _ORIGINALS[name] = getattr(cls, name)
        setattr(cls, name, fn)
    setattr(cls, _MARK, True)


def uninstall() -> None:
    """Restore fairseq's methods (tests use it to compare with stock fairseq)."""
    cls = fairseq_trainer.Trainer
    if not is_installed():
        return
    for name in _REPLACEMENTS:
        setattr(cls, name, _ORIGINALS[name])
    delattr(cls, _MARK)
