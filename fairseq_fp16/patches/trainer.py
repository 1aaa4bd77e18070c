"""Patches of ``fairseq.trainer.Trainer``: the plugin's optimizer, bf16 off TPUs, the overflow
handler off CUDA, and an fp32 EMA of the masters.

The trainer and the plugin's optimizer wrapper talk through the wrapper's own attributes: the
trainer asks ``isinstance(optimizer, MixedPrecisionFairseqOptimizer)`` and then reads its
``overflow`` record (whether this update overflowed, why the run stopped) and calls
``begin_epoch``; the EMA the trainer builds is a :class:`fairseq_fp16.ema.MastersEMA`, which
the trainer tells which wrapper's masters to average."""

from __future__ import annotations

import inspect
import logging
import os
import sys
from itertools import chain
from typing import Optional

from fairseq.logging import metrics
from fairseq.optim import lr_scheduler
from fairseq.trainer import Trainer

from ..context import RUN_INFO, run_context
from ..core.param_names import tag_param_names
from ..ema import MastersEMA
from ..optim.mixed_precision import MixedPrecisionFairseqOptimizer
from ..optim.stock_state import history_names
from ..precision import Precision
from ..tasks.translation_fp16 import BATCH_LENGTHS_KEY
from .registry import Patch
from .registry import original as _original

logger = logging.getLogger(__name__)

INIT = "fairseq.trainer:Trainer.__init__"
BUILD_OPTIMIZER = "fairseq.trainer:Trainer._build_optimizer"
TRAIN_STEP = "fairseq.trainer:Trainer.train_step"
STATE_DICT = "fairseq.trainer:Trainer.state_dict"
BEGIN_EPOCH = "fairseq.trainer:Trainer.begin_epoch"
BUILD_EMA = "fairseq.trainer:build_ema"



def _tpu_requested() -> bool:
    return any(a == "--tpu" for a in sys.argv[1:])


def _init(self, cfg, task, model, criterion, quantizer=None):
    common = getattr(cfg, "common", None)
    if common is not None and common.bf16 and common.tpu and not _tpu_requested():
        logger.info("fairseq_fp16: --bf16 on %s, not on TPU (pass --tpu for XLA)",
                    "CPU" if common.cpu else "the default device")
        common.tpu = False
    checkpoint, dt = getattr(cfg, "checkpoint", None), getattr(cfg, "distributed_training", None)
    if checkpoint is not None and not checkpoint.no_save and not getattr(dt, "distributed_rank", 0):
        run_context(task).record.set_path(os.path.join(checkpoint.save_dir, RUN_INFO))
    _original(INIT)(self, cfg, task, model, criterion, quantizer)


def plugin_optimizer_applies(cfg) -> bool:
    """Whether the plugin's optimizer wrapper covers this set-up (else fairseq's own is built)."""
    dt = cfg.distributed_training
    return not (
        dt.ddp_backend == "fully_sharded"
        or cfg.common.memory_efficient_fp16
        or cfg.common.memory_efficient_bf16
        or cfg.common.amp
        or cfg.optimization.use_bmuf
        or dt.zero_sharding != "none"
    )


def _build_optimizer(self):
    common = self.cfg.common
    if (common.memory_efficient_fp16 or common.memory_efficient_bf16) and \
            getattr(self.cfg.optimizer, "_name", None) == "fp16_adam":
        flag = "--memory-efficient-fp16" if common.memory_efficient_fp16 else "--memory-efficient-bf16"
        raise ValueError(
            f"{flag} keeps no fp32 master weights, and --optimizer fp16_adam updates fp32 masters: "
            f"use {flag.replace('memory-efficient-', '')} alone (the plugin drops the fp32 gradients "
            "between steps), or fairseq's --optimizer adam with " + flag)
    if not plugin_optimizer_applies(self.cfg):
        logger.info("fairseq_fp16: this set-up uses fairseq's own optimizer wrapper")
        return _original(BUILD_OPTIMIZER)(self)
    named = [
        (n, p)
        for n, p in chain(self.model.named_parameters(), self.criterion.named_parameters())
        if p.requires_grad
    ]
    tag_param_names(named)
    self._optimizer = MixedPrecisionFairseqOptimizer(
        self.cfg, [p for _, p in named], _run_precision(self),
        compile_step=bool(run_context(self.task).flags.compile_step))
    run_context(self.task).record.record(compile_step=self._optimizer.compiles_step)
    if self.cfg.ema.store_ema and isinstance(self.ema, MastersEMA):
        self.ema.follow(self._optimizer)
    self._optimizer.watch_forward(self._model)
    self._lr_scheduler = lr_scheduler.build_lr_scheduler(self.cfg.lr_scheduler, self.optimizer)
    self._lr_scheduler.step_update(0)


def _run_precision(trainer) -> Precision:
    """The precision of the trainer's run: its task's run context's, which must be what the
    trainer's own configuration says.

    Raises:
        RuntimeError: where they differ (a task whose config does not reach the run's
            ``common`` flags).
    """
    precision = run_context(trainer.task).precision
    own = Precision.from_cfg(trainer.cfg)
    if (precision.name, precision.loss_scale) != (own.name, own.loss_scale):
        raise RuntimeError(
            f"fairseq_fp16: the task's configuration says {precision.name} ({precision.loss_scale})"
            f" but the trainer's says {own.name} ({own.loss_scale}); the task must be built from "
            "the run's configuration (tasks.setup_task(cfg.task))")
    return precision


def _build_ema(model, cfg, device):
    return MastersEMA(model, cfg, device)


def _plugin_optimizer(trainer) -> Optional[MixedPrecisionFairseqOptimizer]:
    """The trainer's optimizer if it is the plugin's wrapper (fairseq's own in the set-ups the
    wrapper does not cover), without building one."""
    opt = trainer._optimizer
    return opt if isinstance(opt, MixedPrecisionFairseqOptimizer) else None


def _state_dict(self):
    state = _original(STATE_DICT)(self)
    optimizer = _plugin_optimizer(self)
    state["optimizer_history"] = history_names(
        state["optimizer_history"], None if optimizer is None else optimizer.history_name)
    state["extra_state"][BATCH_LENGTHS_KEY] = getattr(self.task, "length_multiple", 1)
    return state


def _begin_epoch(self, epoch):
    _original(BEGIN_EPOCH)(self, epoch)
    if isinstance(self.optimizer, MixedPrecisionFairseqOptimizer):
        self.optimizer.begin_epoch(epoch)


def _train_step(self, samples, raise_oom=False):
    try:
        return _original(TRAIN_STEP)(self, samples, raise_oom)
    except Exception as e:
        opt = _plugin_optimizer(self)
        stop = opt.overflow.stop_error if opt is not None else None
        if stop is not None:
            if e is not stop:  # fairseq's NanDetector re-run of the batch failed
                logger.warning("fairseq's NanDetector re-run failed (%s: %s); the reason the "
                               "run stopped is:", type(e).__name__, e)
            raise stop from None
        if not isinstance(e, (AssertionError, RuntimeError)):
            raise
        if self.cuda or opt is None or not opt.overflow.pending:
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


PATCHES = [
    Patch(INIT, group="repair", replacement=_init,
          expects=["self.tpu = cfg.common.tpu", "self._model = self._model.half()"],
          why="fairseq's option parsing turns --bf16 into --tpu, sending the run down the XLA "
              "path; the implied --tpu is cleared unless --tpu was on the command line (and "
              "SAVE_DIR/run_info.json, what the run used, gets its path)"),
    Patch(BUILD_OPTIMIZER, group="precision", replacement=_build_optimizer,
          expects=["optim.FP16Optimizer.build_optimizer(self.cfg, params)",
                   "self._lr_scheduler = lr_scheduler.build_lr_scheduler(",
                   "self._lr_scheduler.step_update(0)"],
          why="builds the plugin's MixedPrecisionFairseqOptimizer (fp32 masters, loss scaler, "
              "fused step; a pass-through in fp32) instead of FP16Optimizer, which fails off "
              "CUDA; set-ups it does not cover (FSDP, --memory-efficient-fp16/bf16, --amp, "
              "BMUF, ZeRO) keep fairseq's"),
    Patch(TRAIN_STEP, group="repair", replacement=_train_step,
          expects=["except OverflowError as e:", "grad_norm = torch.tensor(0.0).cuda()",
                   'metrics.log_stop_time("train_wall")', "self.optimizer.scaler.loss_scale"],
          why="fairseq's overflow handler ends with torch.tensor(0.0).cuda(), which fails off "
              "CUDA: the rest of the handler is done here; and when the optimizer stops the "
              "run, fairseq's NanDetector re-run (broken with torch 2.x on dict outputs) is "
              "replaced by the optimizer's own error"),
    Patch(BEGIN_EPOCH, group="precision", replacement=_begin_epoch,
          expects=["self.lr_step_begin_epoch(epoch)"],
          why="a per-epoch --update-freq changes the default loss-scale window with the epoch "
              "(fairseq computes it once, from the first entry)"),
    Patch(BUILD_EMA, group="precision", replacement=_build_ema,
          condition=lambda build: None if "self._ema = build_ema(" in inspect.getsource(Trainer._build_ema)
          else "Trainer._build_ema no longer calls build_ema",
          why="--ema-fp32 averages the model's state dict, which in a half run holds the rounded "
              "half weights; the trainer builds a MastersEMA, which averages the fp32 masters of "
              "the optimizer wrapper the trainer tells it to follow"),
    Patch(STATE_DICT, group="precision", replacement=_state_dict,
          expects=['"optimizer_name": self.optimizer.__class__.__name__',
                   '"optimizer_history": (self._optim_history or [])'],
          why="checkpoints record the optimizer's class name, and the wrapper's is one class for "
              "every precision; the history names the --optimizer the run wrapped and the "
              "precision instead, and each loaded entry the name it was saved with"),
]
