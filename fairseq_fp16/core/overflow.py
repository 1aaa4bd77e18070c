"""What a mixed-precision run's overflows have done so far, and why it stops (no fairseq import).

:class:`OverflowRecord` is the one owner of a run's overflow counters: the optimizer wrapper
records each update's outcome in it, the trainer patch asks it whether the update overflowed
and why the run stopped, the traces read its counts, and the checkpoint keeps them.
:func:`stop_cause` words the reason a run that cannot heal stops, from what the diagnostics
found.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional

__all__ = ["OverflowRecord", "stop_cause"]


@dataclass
class OverflowRecord:
    """The overflow counters of a run.

    Attributes:
        skipped: updates skipped for overflow (all of them; kept in checkpoints).
        consecutive: counted overflows in a row (those a smaller loss scale cannot fix; kept
            in checkpoints), against ``--max-consecutive-overflows``.
        pending: this update overflowed (until the next update starts).
        stop_error: why the run stopped, once it did.
    """

    skipped: int = 0
    consecutive: int = 0
    pending: bool = False
    stop_error: Optional[FloatingPointError] = None

    def overflowed(self) -> None:
        """This update overflowed and is skipped."""
        self.skipped += 1
        self.pending = True

    def count(self, limit: int) -> bool:
        """Count an overflow a smaller scale cannot fix; True once ``limit`` (> 0) are in a row."""
        self.consecutive += 1
        return self.consecutive >= limit

    def finite(self) -> None:
        """This update's gradients were finite: the run of overflows is over."""
        self.consecutive = 0

    def next_update(self) -> None:
        self.pending = False

    def stop(self, error: FloatingPointError) -> FloatingPointError:
        """Record why the run stops; returns ``error`` to raise."""
        self.stop_error = error
        return error

    def state_dict(self) -> Dict[str, int]:
        return {"num_skipped": self.skipped, "consecutive_overflows": self.consecutive}

    def load_state_dict(self, state: Dict) -> None:
        """Restore :meth:`state_dict`'s counts (absent ones are 0: an older checkpoint)."""
        self.skipped = int(state.get("num_skipped", 0))
        self.consecutive = int(state.get("consecutive_overflows", 0))


def stop_cause(*, first_nonfinite: Optional[Dict] = None, loss_finite: bool = True,
               culprits: Optional[List[Dict]] = None, static_fp16_scale: Optional[float] = None
               ) -> str:
    """Why the gradients keep overflowing, and what to change, from the diagnostics' findings.

    Args:
        first_nonfinite: the first module whose forward output was not finite
            (:class:`~fairseq_fp16.core.diagnostics.NonFiniteWatch`), or None.
        loss_finite: whether every loss of the update was finite.
        culprits: the parameters whose gradients overflowed
            (:func:`~fairseq_fp16.core.diagnostics.attribute_overflow`).
        static_fp16_scale: the static loss scale of an fp16 run (None otherwise).
    """
    if first_nonfinite is not None:
        first = first_nonfinite
        return (f"the forward pass is not finite: first {first['kind']} in the output of "
                f"{first['module']} ({first['type']}, {first['dtype']}), which loss scaling cannot "
                f"fix; keep it in fp32 (--fp32-modules '{re.escape(first['module'])}'), try "
                "--bf16, lower --lr, or check the input data")
    if not loss_finite:
        return ("the forward pass is finite up to the model's output but the loss is not: "
                "check the criterion and the batch (empty or corrupt targets)")
    if not culprits:
        return ("the gradient norm overflowed although every gradient is finite (the sum of "
                "their squares exceeds the fp32 range): the gradients have grown enormous; "
                "lower --lr, and clip with --clip-norm so that the updates stay bounded")
    names = ", ".join(c["param"] for c in culprits)
    if static_fp16_scale is not None:
        return (f"the forward pass and loss are finite, but the gradients overflow fp16 at the "
                f"static loss scale {static_fp16_scale:.12g}, which is too high for them (in: "
                f"{names}); lower --loss-scale, or use --loss-scale 0 (dynamic: the scale backs "
                "off until the gradients fit)")
    return (f"the forward pass and loss are finite; gradients overflow in: {names}; lower --lr, "
            "clip with --clip-norm, or keep those modules in fp32 (--fp32-modules)")
