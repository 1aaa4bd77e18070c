"""The fairseq face of the mixed-precision optimizer.

:class:`MixedPrecisionFairseqOptimizer` is what the trainer hook builds for
every run with the plugin loaded: under ``--fp16``/``--bf16`` it drives
:class:`fairseq_fp16.core.MixedPrecisionOptimizer` (fp32 masters, loss scaler,
fused step); in fp32 it passes every call through to the inner optimizer
unchanged. One class for all precisions keeps the ``optimizer_name`` that
fairseq stores in checkpoints the same, so an fp32 checkpoint resumes under
``--fp16`` and an fp16 one under fp32 without ``--reset-optimizer``.

Overflow protocol (fairseq's): :meth:`clip_grad_norm` raises
``OverflowError`` when the gradients overflowed (the trainer skips the
update) and ``FloatingPointError`` when the run cannot heal (the trainer
stops): the scale reached ``--min-loss-scale``, or ``--max-consecutive-overflows``
updates in a row were skipped. The second message names the first module whose
forward output was not finite (:class:`~fairseq_fp16.core.diagnostics.NonFiniteWatch`,
armed only after an overflow) or, when the forward pass was finite, the cause
that applies: a non-finite loss, a static ``--loss-scale`` too high for fp16, a
gradient norm that overflowed although every gradient is finite, or the
parameters whose gradients overflowed. The opt-in traces are :mod:`.traces`.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, Optional

import torch
from fairseq import optim
from fairseq.logging import metrics
from fairseq.optim import FairseqOptimizer

from ..core.diagnostics import NonFiniteWatch, attribute_overflow
from ..core.loss_scaler import LossScaler
from ..core.master_weights import MixedPrecisionOptimizer
from ..core.overflow import OverflowRecord, stop_cause
from ..core.param_names import param_name
from ..core.ranks import agree_on_every_rank, first_on_any_rank
from .stock_state import (PLUGIN_TAG, STOCK_HALF, check_same_optimizer, describe_state, import_stock_state,
                          stock_loss_scale)
from .traces import Diagnostics
from ..precision import Precision

logger = logging.getLogger(__name__)

__all__ = ["BF16_MAX_SCALE", "MixedPrecisionFairseqOptimizer", "build_loss_scaler"]

BF16_MAX_SCALE = 2.0**24


def _section(cfg, name: str):
    """``cfg.<name>`` or None: fairseq's own test configurations carry only some groups."""
    try:
        return getattr(cfg, name, None)
    except Exception:  # omegaconf's missing-key errors
        return None


def default_scale_window(cfg, epoch: int) -> int:
    """fairseq's default ``--fp16-scale-window``: 2**14 / (world size x update-freq), with the
    ``--update-freq`` of ``epoch`` (fairseq takes a list, one entry per epoch, the last one
    for every later epoch), so that the batches between scale increases stay constant."""
    dt, opt = _section(cfg, "distributed_training"), _section(cfg, "optimization")
    world = max(1, int(getattr(dt, "distributed_world_size", 1) or 1))
    freqs = list(getattr(opt, "update_freq", None) or [1])
    freq = int(freqs[min(epoch, len(freqs)) - 1])
    return max(1, int(2**14 / world / freq))


def build_loss_scaler(cfg, precision: Precision, device: torch.device) -> LossScaler:
    """The loss scaler for a run, from fairseq's flags and the task's.

    ``precision.loss_scale`` (``--loss-scale``): dynamic, static, or none (a static 1).
    Dynamic scaling reads ``--fp16-init-scale``, ``--fp16-scale-window``,
    ``--fp16-scale-tolerance``, ``--min-loss-scale``, ``--threshold-loss-scale``
    and ``--loss-scale-hysteresis``.
    """
    spec = precision.loss_scale
    if not spec.dynamic:
        return LossScaler(spec.scale or 1.0, dynamic=False, device=device)
    hysteresis = int(getattr(_section(cfg, "task"), "loss_scale_hysteresis", 1) or 1)
    window = cfg.common.fp16_scale_window
    if window is None:
        window = default_scale_window(cfg, epoch=1)
    return LossScaler(
        float(cfg.common.fp16_init_scale),
        dynamic=True,
        scale_window=int(window),
        tolerance=float(cfg.common.fp16_scale_tolerance),
        hysteresis=hysteresis,
        min_scale=float(cfg.common.min_loss_scale),
        threshold=cfg.common.threshold_loss_scale,
        # bf16 gradients do not overflow at any usual scale: without a ceiling its dynamic
        # scale would double every window up to inf (apex's scaler stops at 2**24 too)
        max_scale=BF16_MAX_SCALE if precision.name == "bf16" else None,
        device=device,
    )


class _ScaleView:
    """What fairseq's trainer reads as ``optimizer.scaler``.

    The trainer logs ``scaler.loss_scale`` every update; a tensor copy keeps
    that free of host syncs (fairseq's meters read it at log time).
    """

    def __init__(self, scaler: LossScaler) -> None:
        self._scaler = scaler

    @property
    def loss_scale(self) -> torch.Tensor:
        return self._scaler.scale_tensor.detach().clone()


class MixedPrecisionFairseqOptimizer(FairseqOptimizer):
    """fp32 master weights + loss scaling for any fairseq optimizer.

    The work is done by a strategy chosen once from the precision: :class:`_Passthrough`
    (fp32: every call goes to fairseq's optimizer unchanged) or :class:`_MasterWeights`
    (fp16/bf16). One class for all precisions keeps the ``optimizer_name`` that fairseq stores
    in checkpoints the same, so a run resumes across precisions.

    Args:
        cfg: the full fairseq config (``optimizer``, ``common``, ``task``...).
        params: the model's trainable parameters, in the model's dtype.
        precision: the run's :class:`~fairseq_fp16.precision.Precision` (the trainer patch
            passes ``Precision.from_cfg(cfg)``).
        compile_step: ``--compile-step``: a half run's update in one compiled loop a parameter
            (:mod:`fairseq_fp16.core.compiled_adam`); nothing changes in fp32, where torch's
            fused AdamW is one loop already.

    Raises:
        TypeError: when ``precision`` is not a Precision (a name would be parsed a second time,
            apart from the run's flags).
    """

    def __init__(self, cfg, params, precision: Precision, compile_step: bool = False) -> None:
        super().__init__(cfg.optimizer)
        if not isinstance(precision, Precision):
            raise TypeError(f"precision must be a fairseq_fp16.precision.Precision, got {precision!r}")
        self.precision = precision.name
        #: the --optimizer it wraps, recorded in checkpoints: a resume with another is refused
        self.optimizer_name = getattr(_section(cfg, "optimizer"), "_name", None)
        params = list(params)
        #: the run's overflow counters (the trainer patch reads it; checkpoints keep its counts)
        self.overflow = OverflowRecord()
        self._params = params
        if precision.is_half:
            self.strategy = _MasterWeights(self, cfg, params, precision, compile_step)
        else:
            if compile_step:
                logger.info("fairseq_fp16: --compile-step changes nothing in fp32 (torch's fused "
                            "AdamW updates an fp32 parameter in one loop)")
            self.strategy = _Passthrough(self, cfg, params)
        self.inner = self.strategy.inner
        self._optimizer = self.inner.optimizer

    # what the trainer, the task and the diagnostics read
    @property
    def loss_scaler(self) -> Optional[LossScaler]:
        return self.strategy.loss_scaler

    @property
    def diagnostics(self):
        return self.strategy.diagnostics

    @property
    def watch(self) -> Optional[NonFiniteWatch]:
        return self.strategy.watch

    @property
    def history_name(self) -> str:
        """What the checkpoint's optimizer history names this run's optimizer by (the class of
        the --optimizer it wraps, and the precision; fairseq's trainer saves the class name)."""
        return f"{type(self.inner).__name__}{PLUGIN_TAG}{self.precision})"

    @property
    def optimizer_config(self):
        return self.inner.optimizer_config

    @property
    def fp32_params(self):
        """The fp32 master weights (half runs; None in fp32), as fairseq's FP16Optimizer
        exposes its own for wrappers that average them (SlowMo)."""
        core = self.strategy.core
        return None if core is None else core.master_params

    @property
    def compiles_step(self) -> bool:
        """Whether the update runs compiled from the half gradients (``--compile-step`` in a half
        run)."""
        core = self.strategy.core
        return core is not None and core.compiles_step

    def masters_by_param(self) -> Dict[int, torch.Tensor]:
        """``id(model parameter) -> its fp32 master`` for the half parameters (none in fp32)."""
        core = self.strategy.core
        return {} if core is None else core.masters_by_param()

    @property
    def supports_flat_params(self):
        return False

    def watch_forward(self, model: torch.nn.Module) -> None:
        """Hook ``model`` so that a run that cannot heal names its first non-finite module."""
        self.strategy.watch_forward(model)

    def backward(self, loss):
        self.strategy.backward(loss)

    def multiply_grads(self, c):
        self.strategy.multiply_grads(c)

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        return self.strategy.clip_grad_norm(max_norm, aggregate_norm_fn)

    def step(self, closure=None, scale=1.0, groups=None):
        return self.strategy.step(closure, scale, groups)

    def zero_grad(self):
        self.overflow.next_update()
        self.strategy.zero_grad()

    def begin_epoch(self, epoch: int) -> None:
        """Follow a per-epoch ``--update-freq`` with the default scale window (trainer patch)."""
        self.strategy.begin_epoch(epoch)

    def state_dict(self) -> Dict[str, Any]:
        state = self.strategy.state_dict()
        state["precision"] = self.precision
        state["optimizer_name"] = self.optimizer_name
        state.update(self.overflow.state_dict())
        return state

    def load_state_dict(self, state_dict, optimizer_overrides=None):
        """Load a state from any precision, a bare torch optimizer state, or a stock fairseq
        optimizer's (:mod:`fairseq_fp16.optim.stock_state`).

        Raises:
            ValueError: for a state written with another ``--optimizer`` (fairseq's advice:
                ``--reset-optimizer``).
        """
        if "precision" not in state_dict:  # a plain optimizer state
            state_dict = {"precision": "fp32", "optimizer": state_dict}
        stock = state_dict["precision"] == "stock"
        check_same_optimizer(state_dict.get("stock_optimizer" if stock else "optimizer_name"),
                             self.optimizer_name, stock)
        if stock:
            state_dict = self.strategy.from_stock(state_dict)
            logger.info("fairseq_fp16: resumed from stock fairseq's %s state: %s%s carried over",
                        state_dict.pop("stock"), describe_state(state_dict["optimizer"]),
                        "".join(f", {k}" for k in state_dict.pop("carried")))
        self.overflow.load_state_dict(state_dict)
        self.strategy.load_state_dict(state_dict, optimizer_overrides)


class _Passthrough:
    """fp32: fairseq's optimizer, every call passed through unchanged."""

    core = None
    loss_scaler = None
    diagnostics = None
    watch = None

    def __init__(self, owner: MixedPrecisionFairseqOptimizer, cfg, params) -> None:
        self.owner = owner
        self.inner = optim.build_optimizer(cfg.optimizer, params)

    def watch_forward(self, model) -> None:
        pass

    def begin_epoch(self, epoch: int) -> None:
        pass

    def backward(self, loss):
        self.inner.backward(loss)

    def multiply_grads(self, c):
        self.inner.multiply_grads(c)

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        return self.inner.clip_grad_norm(max_norm, aggregate_norm_fn)

    def step(self, closure=None, scale=1.0, groups=None):
        return self.inner.step(closure, scale=scale, groups=groups)

    def zero_grad(self):
        self.inner.zero_grad()

    def state_dict(self) -> Dict[str, Any]:
        return {"optimizer": self.inner.state_dict()}

    def from_stock(self, state_dict) -> Dict[str, Any]:
        params = self.owner._params
        torch_state = import_stock_state(state_dict["stock"], state_dict["stock_state"],
                                         self.inner.optimizer, params, params)
        return {"precision": "fp32", "optimizer": torch_state, "stock": state_dict["stock"], "carried": []}

    def load_state_dict(self, state_dict, optimizer_overrides=None):
        self.inner.load_state_dict(state_dict["optimizer"], optimizer_overrides)
        # A half checkpoint continuing in fp32: take the exact fp32 masters instead of the
        # rounded half weights.
        params = self.owner._params
        with torch.no_grad():
            for i, t in (state_dict.get("master_params") or {}).items():
                if int(i) >= len(params) or params[int(i)].shape != t.shape:
                    raise ValueError("checkpoint's fp32 master weights do not match the model")
                params[int(i)].copy_(t)


class _MasterWeights:
    """fp16/bf16: fp32 master weights, the loss scaler and fairseq's overflow protocol."""

    def __init__(self, owner: MixedPrecisionFairseqOptimizer, cfg, params, precision: Precision,
                 compile_step: bool) -> None:
        self.owner = owner
        self.precision = precision
        self.max_consecutive_overflows = int(
            getattr(_section(cfg, "task"), "max_consecutive_overflows", 0) or 0)
        self._cfg = cfg
        self.watch: Optional[NonFiniteWatch] = None
        self._losses = []  # this update's losses, read only on an overflow
        self.loss_scaler = build_loss_scaler(cfg, precision, params[0].device)
        built: Dict[str, FairseqOptimizer] = {}

        def build(master_params):
            built["inner"] = optim.build_optimizer(cfg.optimizer, master_params)
            return built["inner"].optimizer

        self.core = MixedPrecisionOptimizer(params, build, self.loss_scaler, compile_step=compile_step)
        self.inner = built["inner"]
        owner.scaler = _ScaleView(self.loss_scaler)
        self.diagnostics = Diagnostics.from_cfg(cfg, precision.dtype)
        logger.info(
            "fairseq_fp16: %s model, fp32 master weights, %s, %s step",
            precision.name,
            self.loss_scaler,
            "compiled, one loop a parameter (--compile-step)" if compile_step
            else "fused (no host sync)" if self.core.fused_amp else "unfused (1 host sync)",
        )

    def watch_forward(self, model: torch.nn.Module) -> None:
        if self.max_consecutive_overflows and self.watch is None:
            self.watch = NonFiniteWatch(model)

    def begin_epoch(self, epoch: int) -> None:
        scaler = self.loss_scaler
        if scaler.dynamic and self._cfg.common.fp16_scale_window is None:
            window = default_scale_window(self._cfg, epoch)
            if window != scaler.scale_window:
                logger.info("fairseq_fp16: --update-freq of epoch %d: loss-scale window %d updates",
                            epoch, window)
                scaler.scale_window = window

    def backward(self, loss):
        self._losses.append(loss.detach())
        self.core.backward(loss)

    def multiply_grads(self, c):
        self.core.multiply_grads(c)

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        record = self.owner.overflow
        grad_norm = self.core.clip_grad_norm(max_norm)
        if aggregate_norm_fn is not None:
            grad_norm = aggregate_norm_fn(grad_norm)
        # The trainer reads grad_norm right after this call; the overflow test
        # here is that same host sync, not an extra one (tested on the host: no kernel).
        overflow = not math.isfinite(float(grad_norm))
        diag = self.diagnostics
        if diag is not None:
            diag.begin_update()
        if overflow:
            record.overflowed()
            # Only on this (already synced) overflow step: name the culprits.
            culprits = attribute_overflow(self.core.model_params)
            if culprits:
                logger.info("gradient overflow in: %s", ", ".join(
                    f"{c['param']} ({c['nonfinite']} of {c['numel']} non-finite)" for c in culprits))
            else:
                logger.info("gradient norm overflow: every gradient is finite, the sum of their "
                            "squares is not")
            self.core.skip_step()
            self._log_counters()
            if diag is not None:
                diag.trace(grad_norm, overflow=True, skipped=record.skipped,
                           loss_scale=self.loss_scaler.loss_scale, culprits=culprits)
            try:
                self.loss_scaler.check_min_scale()  # FloatingPointError stops the run
                self._count_overflow(culprits)
            except FloatingPointError as e:
                raise record.stop(e)  # the trainer patch re-raises it if fairseq's re-run fails
            raise OverflowError(f"setting loss scale to: {self.loss_scaler.loss_scale:.12g}")
        self.core.note_finite()  # the unfused step need not check again
        record.finite()
        if self.watch is not None:
            self.watch.disarm()
        self._log_counters()
        if diag is not None:
            diag.note_finite(grad_norm, skipped=record.skipped, params=self.core.model_params)
        return grad_norm

    def _count_overflow(self, culprits) -> None:
        """Arm the forward watch; stop after ``--max-consecutive-overflows`` in a row.

        Counted are the overflows that a smaller scale cannot fix: a non-finite loss, or any
        overflow under a static scale. A dynamic scale searching downwards from a high
        ``--fp16-init-scale`` (finite losses, overflowing gradients) is not counted; if it
        never finds a scale, ``--min-loss-scale`` stops the run.
        """
        if self.watch is not None and not self.watch.armed:
            self.watch.arm()
        limit = self.max_consecutive_overflows
        if not limit:
            return
        # Every rank is here on the same update (the all-reduced gradients overflowed on all of
        # them), so each decision below is taken over all ranks: a rank deciding alone would
        # stop while the others wait in the next all-reduce.
        loss_finite = agree_on_every_rank(all(bool(torch.isfinite(t).all()) for t in self._losses),
                                     self.loss_scaler.scale_tensor.device)
        if loss_finite and self.loss_scaler.dynamic:
            return
        record = self.owner.overflow
        if not record.count(limit):
            return
        first = first_on_any_rank(self.watch.first if self.watch is not None else None)
        static_fp16 = self.precision.name == "fp16" and not self.loss_scaler.dynamic
        cause = stop_cause(first_nonfinite=first, loss_finite=loss_finite, culprits=culprits,
                           static_fp16_scale=self.loss_scaler.loss_scale if static_fp16 else None)
        raise FloatingPointError(
            f"fairseq_fp16: {record.consecutive} consecutive updates skipped for "
            f"non-finite gradients (--max-consecutive-overflows {limit}; loss scale now "
            f"{self.loss_scaler.loss_scale:.6g}): {cause}"
        )

    def _log_counters(self) -> None:
        metrics.log_scalar("skipped", self.owner.overflow.skipped, priority=710, round=0, weight=0)
        if self.precision.name == "bf16":  # the trainer logs loss_scale for fp16 only
            metrics.log_scalar("loss_scale", self.owner.scaler.loss_scale, priority=700, round=4, weight=0)

    def step(self, closure=None, scale=1.0, groups=None):
        if closure is not None:
            raise ValueError("the mixed-precision optimizer does not take a closure")
        if scale != 1.0:
            self.core.multiply_grads(1.0 / scale)
        diag = self.diagnostics
        if diag is not None and diag.pending_stats is not None:
            diag.lost.before_step(self.core.master_params)
        self.core.step()
        if diag is not None:
            diag.after_step(skipped=self.owner.overflow.skipped,
                            loss_scale=self.loss_scaler.loss_scale)

    def zero_grad(self):
        self._losses = []
        self.core.zero_grad()

    def state_dict(self) -> Dict[str, Any]:
        return self.core.state_dict()

    def from_stock(self, state_dict) -> Dict[str, Any]:
        core, stock = self.core, state_dict["stock"]
        torch_state = import_stock_state(stock, state_dict["stock_state"], core.optimizer,
                                         core.master_params, core.model_params)
        carried, scaler = [], None
        scale = stock_loss_scale(state_dict["stock_state"])
        if scale is not None and self.loss_scaler.dynamic:
            scaler = dict(self.loss_scaler.state_dict(), scale=scale, prev_scale=scale)
            carried.append(f"loss scale {scale:g}")
        masters, names = self._masters_from(state_dict.get("fp32_weights") or {})
        if masters and stock not in STOCK_HALF:
            carried.append("fp32 weights as masters")
        return {"precision": self.precision.name, "optimizer": torch_state, "scaler": scaler,
                "master_params": masters, "master_names": names, "stock": stock, "carried": carried}

    def _masters_from(self, weights: Dict[str, torch.Tensor]):
        """(masters, names) by parameter position: each half parameter's fp32 weight in
        ``weights`` (an fp32 checkpoint's model, by name)."""
        masters, names = {}, {}
        for i, p in self.core.half_params():
            name = param_name(p)
            if name in weights:
                masters[i], names[i] = weights[name], name
        return masters, names

    def load_state_dict(self, state_dict, optimizer_overrides=None):
        saved = dict(state_dict)
        if state_dict["precision"] == "fp32":
            saved["scaler"] = None  # an fp32 run has no scale to continue
            if not saved.get("master_params"):  # its weights are exact: the masters
                saved["master_params"], saved["master_names"] = self._masters_from(
                    state_dict.get("fp32_weights") or {})
        self.core.load_state_dict(saved)
        if self.diagnostics is not None:  # the trace's update numbers continue: every attempted
            self.diagnostics.attempt = int(self.loss_scaler.state_dict()["num_updates"])  # update
        if optimizer_overrides:
            for group in self.owner.param_groups:
                group.update(optimizer_overrides)
