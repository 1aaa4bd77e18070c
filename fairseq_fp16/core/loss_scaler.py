"""Loss scaling for half-precision training (pure torch, no fairseq import).

The scale and its counters live in 0-dim tensors on the device of the loss, so
:meth:`LossScaler.update` costs no host sync: the overflow flag produced by the
gradient check is consumed on the device. Only :attr:`LossScaler.loss_scale`
(a Python float), :meth:`LossScaler.check_min_scale` and
:meth:`LossScaler.state_dict` read the device, and callers use them on overflow
steps, at log intervals and at checkpoint time.

Typical loop::

    scaler = LossScaler(init_scale=2.0**7, scale_window=2000)
    for batch in data:
        loss = model(batch)
        scaler.scale(loss).backward()          # loss * scale, no sync
        found_inf = ...                        # 1.0 where any gradient is inf/nan
        optimizer.step(grad_scale=scaler.scale_tensor, found_inf=found_inf)
        scaler.update(found_inf)               # on device, no sync
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch

__all__ = ["SCALE_RANGE", "LossScaler", "check_scale_range", "parse_loss_scale"]


def parse_loss_scale(value: Any, flag: str = "--loss-scale") -> Optional[float]:
    """Validate a ``--loss-scale`` value.

    Returns ``0.0`` for dynamic scaling, the scale for a static one, or ``None``
    when no value was given (the precision's default applies).

    Raises:
        ValueError: naming ``flag`` when the value is not a number, negative,
            or positive but not a power of two.
    """
    if value is None:
        return None
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{flag} must be 0 (dynamic) or a positive power of two, got {value!r}"
        ) from None
    if scale == 0.0:
        return 0.0
    if not math.isfinite(scale) or scale < 0 or math.frexp(scale)[0] != 0.5:
        raise ValueError(
            f"{flag} must be 0 (dynamic) or a positive power of two "
            f"(e.g. 128, 1024, 0.5), got {value!r}"
        )
    check_scale_range(scale, value, flag)
    return scale


#: the powers of two a scale held in fp32 can take (normal numbers)
SCALE_RANGE = (2.0**-126, 2.0**127)


def check_scale_range(scale: float, value: Any, flag: str) -> None:
    """Refuse a loss scale fp32 cannot hold: above fp32's largest power of two, or below its
    smallest normal one.

    Raises:
        ValueError: naming ``flag``, the bound and ``value`` as given.
    """
    if scale > SCALE_RANGE[1]:
        raise ValueError(f"{flag} must be at most 2**127 (the largest power of two fp32 holds; the "
                         f"scale is kept in fp32), got {value!r}")
    if scale < SCALE_RANGE[0]:
        raise ValueError(f"{flag} must be at least 2**-126 (the smallest normal power of two of "
                         f"fp32; the scale is kept in fp32), got {value!r}")


class LossScaler:
    """Static or dynamic loss scaler with device-resident state.

    Dynamic scaling is fairseq's ``DynamicLossScaler``, update for update, with
    hysteresis added as DeepSpeed and Megatron define it:

    * after ``scale_window`` consecutive clean updates the scale is multiplied
      by ``scale_factor`` (never above ``max_scale``, when set); a window changed on the way
      (:attr:`scale_window`) grows where the clean updates since the last overflow are a
      multiple of it, as fairseq's does;
    * an overflow skips the update; the scale is divided by ``scale_factor``
      when the overflows since the last back-off, over the updates since the
      last rescale (growth or back-off), are at least ``tolerance`` (fairseq's
      ``--fp16-scale-tolerance``); ``threshold`` (when set) is a floor for that
      back-off;
    * hysteresis: each overflow uses up one of ``hysteresis`` allowances and the
      scale backs off only once none is left; they are replenished when the
      scale grows, not after a back-off, so after ``hysteresis - 1`` absorbed
      overflows every further one backs off until the scale has grown again;
    * :meth:`check_min_scale` raises ``FloatingPointError`` when the scale has
      fallen to ``min_scale`` or below, putting back the scale it had before
      that back-off (as fairseq does).

    Args:
        init_scale: initial (dynamic) or fixed (static) scale.
        dynamic: adjust the scale (``True``) or keep it fixed (``False``).
        scale_window: clean updates before the scale grows.
        scale_factor: growth and back-off factor (2 keeps powers of two).
        tolerance: fairseq's ``--fp16-scale-tolerance``.
        hysteresis: overflows tolerated before backing off (1 = every one).
        min_scale: the scale at or below which training stops.
        threshold: floor for the dynamic back-off (``--threshold-loss-scale``).
        max_scale: ceiling for growth (None: none, as fairseq's fp16 scaler; a
            bf16 run, whose gradients never overflow at these scales, needs one).
        device: device of the state tensors (that of the loss).
    """

    def __init__(
        self,
        init_scale: float = 2.0**7,
        *,
        dynamic: bool = True,
        scale_window: int = 2000,
        scale_factor: float = 2.0,
        tolerance: float = 0.0,
        hysteresis: int = 1,
        min_scale: float = 1e-4,
        threshold: Optional[float] = None,
        max_scale: Optional[float] = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if init_scale <= 0 or not math.isfinite(init_scale):
            raise ValueError(f"init_scale must be positive and finite, got {init_scale}")
        if scale_window < 1:
            raise ValueError(f"scale_window must be >= 1, got {scale_window}")
        if hysteresis < 1:
            raise ValueError(
                f"--loss-scale-hysteresis must be >= 1 (1 backs off at every "
                f"overflow), got {hysteresis}"
            )
        if scale_factor <= 1:
            raise ValueError(f"scale_factor must be > 1, got {scale_factor}")
        if scale_window >= 2**31:
            raise ValueError(f"scale_window must be < 2**31, got {scale_window}")
        self.dynamic = dynamic
        self.init_scale = float(init_scale)
        self._scale_window = int(scale_window)
        self.scale_factor = float(scale_factor)
        self.tolerance = float(tolerance)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.threshold = None if threshold is None else float(threshold)
        # the largest power of two below fp32's maximum: growth never makes the scale inf
        self.max_scale = min(float(max_scale), 2.0**127) if max_scale is not None else 2.0**127
        dev = torch.device(device)
        f32 = dict(dtype=torch.float32, device=dev)
        i64 = dict(dtype=torch.int64, device=dev)
        # Device state: every field of state_dict() below.
        self._scale = torch.full((), self.init_scale, **f32)
        self._prev_scale = torch.full((), self.init_scale, **f32)  # before the last update
        # since the last overflow or growth; int32, as torch's fused scale update counts
        self._clean_steps = torch.zeros((), dtype=torch.int32, device=dev)
        self._hysteresis_left = torch.full((), self.hysteresis, **i64)
        self._overflows_since_rescale = torch.zeros((), **i64)
        self._steps_since_rescale = torch.zeros((), **i64)
        self._num_overflows = torch.zeros((), **i64)
        self._num_updates = torch.zeros((), **i64)
        # _num_updates at the last overflow: a new window counts the clean updates since
        self._last_overflow = torch.zeros((), **i64)
        # fairseq's defaults (every overflow backs off, no floor) with a factor whose inverse is
        # exact: the scale moves as torch's GradScaler moves it, in its one fused kernel
        self._fusable = (dynamic and self.tolerance <= 0 and self.hysteresis == 1
                         and self.threshold is None and math.frexp(self.scale_factor)[0] == 0.5)
        self._ceiling = self._needs_ceiling(self.init_scale)

    def _needs_ceiling(self, scale: float) -> bool:
        """Whether the fused update must clamp a growth to :attr:`max_scale`: where there is
        one below 2**127, or where the scale is not a power of two. A power of two times a
        power-of-two factor stays one, and is at most 2**127 or inf, which torch's fused
        update refuses: the ceiling of 2**127 holds without the two launches."""
        return self.max_scale < 2.0**127 or math.frexp(scale)[0] != 0.5

    # ------------------------------------------------------------------ hot path
    @property
    def scale_tensor(self) -> torch.Tensor:
        """The current scale as a 0-dim fp32 tensor (no sync)."""
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Return ``loss * scale`` (no sync)."""
        return loss * self._scale.to(loss.device)

    def update(self, found_inf: torch.Tensor) -> None:
        """Record one update: ``found_inf`` is nonzero where it overflowed.

        Runs entirely on the device (no host sync).
        """
        found = found_inf.reshape(()).to(self._scale.device)
        overflow = found > 0
        if not self.dynamic:
            self._num_updates.add_(1)
            self._num_overflows.add_(overflow)
            return
        # one multi-tensor launch on CUDA for the two counts that every update moves
        torch._foreach_add_([self._num_updates, self._steps_since_rescale], 1)
        self._num_overflows.add_(overflow)
        self._last_overflow.masked_fill_(overflow, self._num_updates)
        if self._fusable:
            self._fused_update(found.float(), overflow)
            return
        ov = overflow.long()
        self._prev_scale.copy_(self._scale)
        self._overflows_since_rescale.add_(ov)
        self._hysteresis_left.sub_(ov).clamp_(min=0)
        pct = self._overflows_since_rescale.double() / self._steps_since_rescale.double()
        back_off = overflow & (self._hysteresis_left <= 0) & (pct >= self.tolerance)
        lowered = self._scale / self.scale_factor
        if self.threshold is not None:
            lowered = lowered.clamp(min=self.threshold)
        new_scale = torch.where(back_off, lowered, self._scale)

        clean = torch.where(overflow, torch.zeros_like(self._clean_steps), self._clean_steps + 1)
        grow = clean >= self.scale_window
        grown = (new_scale * self.scale_factor).clamp(max=self.max_scale)
        new_scale = torch.where(grow, torch.maximum(grown, new_scale), new_scale)

        self._scale.copy_(new_scale)
        self._clean_steps.copy_(torch.where(grow, torch.zeros_like(clean), clean))
        # fairseq: growth and back-off restart the updates counted for the tolerance; only a
        # back-off restarts the overflows. DeepSpeed/Megatron: growth replenishes hysteresis.
        self._steps_since_rescale.masked_fill_(back_off | grow, 0)
        self._overflows_since_rescale.masked_fill_(back_off, 0)
        self._hysteresis_left.masked_fill_(grow, self.hysteresis)

    def _fused_update(self, found: torch.Tensor, overflow: torch.Tensor) -> None:
        """:meth:`update` in 11 kernel launches (13 with a ceiling) rather than 34: an update
        on a fast GPU is bound by the host's launches. Every overflow backs off here, so the
        counters of the tolerance and the hysteresis follow from whether the scale was
        rescaled."""
        self._prev_scale.copy_(self._scale)
        torch._amp_update_scale_(self._scale, self._clean_steps, found, self.scale_factor,
                                 1.0 / self.scale_factor, self.scale_window)
        if self._ceiling:
            # the ceiling (GradScaler has none): a growth stops at max_scale, or where it started
            torch.minimum(self._scale, self._prev_scale.clamp(min=self.max_scale), out=self._scale)
        rescaled = self._clean_steps == 0  # a back-off or a growth restarts the count
        self._steps_since_rescale.masked_fill_(rescaled, 0)
        self._overflows_since_rescale.masked_fill_(overflow, 0)
        self._hysteresis_left.masked_fill_(rescaled, 1).masked_fill_(overflow, 0)

    @property
    def scale_window(self) -> int:
        """Clean updates between growths."""
        return self._scale_window

    @scale_window.setter
    def scale_window(self, window: int) -> None:
        """A new window (a per-epoch ``--update-freq``) counts from the last overflow, as
        fairseq's ``DynamicLossScaler`` does (it grows where the clean updates since the last
        overflow are a multiple of the window): the next growth comes at the next multiple of
        the new window, and the count never starts beyond it (torch's fused update grows only
        where the count reaches the window exactly). On the device, no sync."""
        window = int(window)
        if window < 1:
            raise ValueError(f"scale_window must be >= 1, got {window}")
        self._scale_window = window
        self._clean_steps.copy_(torch.remainder(self._num_updates - self._last_overflow, window))

    # ------------------------------------------------------ reads (host syncs)
    @property
    def loss_scale(self) -> float:
        """The current scale as a Python float (one host sync)."""
        return float(self._scale)

    @property
    def num_overflows(self) -> int:
        """Updates skipped for overflow so far (one host sync)."""
        return int(self._num_overflows)

    def check_min_scale(self) -> None:
        """Raise ``FloatingPointError`` if the scale reached ``min_scale`` (sync).

        Call it after :meth:`update` on an overflow step.
        """
        scale = self.loss_scale
        if self.dynamic and scale <= self.min_scale:
            self._scale.copy_(self._prev_scale)  # as fairseq: the scale before this back-off
            raise FloatingPointError(
                f"Minimum loss scale reached ({self.min_scale}): the gradients "
                f"overflowed at every scale down to {scale}. The loss is probably "
                "diverging: lower the learning rate, add warm-up or --clip-norm, keep "
                "more modules in fp32 (--fp32-modules), or train in --bf16."
            )

    def state_dict(self) -> Dict[str, Any]:
        """Scale, counters and settings as plain Python scalars."""
        return {
            "scale": float(self._scale),
            "prev_scale": float(self._prev_scale),
            "dynamic": self.dynamic,
            "clean_steps": int(self._clean_steps),
            "clean_since_overflow": int(self._num_updates - self._last_overflow),
            "hysteresis_left": int(self._hysteresis_left),
            "overflows_since_rescale": int(self._overflows_since_rescale),
            "steps_since_rescale": int(self._steps_since_rescale),
            "num_overflows": int(self._num_overflows),
            "num_updates": int(self._num_updates),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        A static scaler keeps its configured scale (the flag wins over the
        checkpoint); a dynamic one continues from the saved scale and counters.
        """
        self._num_overflows.fill_(int(state.get("num_overflows", 0)))
        self._num_updates.fill_(int(state.get("num_updates", 0)))
        if self.dynamic and state.get("dynamic", True):
            self._scale.fill_(float(state["scale"]))
            self._ceiling = self._needs_ceiling(float(state["scale"]))
            self._prev_scale.fill_(float(state.get("prev_scale", state["scale"])))
            # a checkpoint of another window (--fp16-scale-window, --update-freq changed on
            # resume) counts on from its last overflow, as a window changed in the run does
            clean = int(state.get("clean_since_overflow", state["clean_steps"]))
            self._last_overflow.copy_(self._num_updates - clean)
            self.scale_window = self._scale_window
            self._hysteresis_left.fill_(
                min(int(state["hysteresis_left"]), self.hysteresis)
            )
            self._overflows_since_rescale.fill_(int(state["overflows_since_rescale"]))
            self._steps_since_rescale.fill_(int(state["steps_since_rescale"]))

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, init_scale={self.init_scale}, window={self.scale_window})"
