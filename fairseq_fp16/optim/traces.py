"""The opt-in traces of a mixed-precision run: ``--scale-trace`` and ``--precision-stats-interval``.

:class:`Diagnostics` is built by the optimizer wrapper
(:class:`~fairseq_fp16.optim.mixed_precision.MixedPrecisionFairseqOptimizer`) when either flag
is set, and called by it at each update: :meth:`~Diagnostics.begin_update` as the gradient
norm is taken, :meth:`~Diagnostics.trace` on an overflow, :meth:`~Diagnostics.note_finite`
on a finite norm and :meth:`~Diagnostics.after_step` once the masters moved.

Every record carries ``update`` (updates attempted, skipped ones included) and
``num_updates`` (updates applied: fairseq's ``num_updates``). The statistics interval counts
applied updates, as fairseq's other intervals do.

The files belong to the run, not to the process: a fresh run starts them empty, and a run
resumed from a checkpoint keeps the records up to that checkpoint and drops the later ones (a
run that went further before the one resumed from is no longer backed by any checkpoint).
Only rank 0 writes: the gradients are all-reduced, so every rank would write the same record.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..core.diagnostics import LostUpdateMonitor, gradient_precision_stats
from ..core.ranks import rank

logger = logging.getLogger(__name__)

__all__ = ["Diagnostics", "summarize"]


class Diagnostics:
    """Opt-in traces of a mixed-precision run (``--scale-trace``, ``--precision-stats-interval``).

    Off, it costs nothing: the wrapper does not build it. On, each update reads
    the scale and gradient norm (host syncs the trace needs), and every
    ``interval`` applied updates the gradient and lost-update statistics are taken.

    Args:
        dtype: the model's half dtype (the format the statistics measure against).
        trace_file: the ``--scale-trace`` file, or None.
        interval: ``--precision-stats-interval`` (0 = no statistics).
        stats_file: where the statistics go (None when ``interval`` is 0).
    """

    FLAGS = {"trace_file": "--scale-trace", "stats_file": "--precision-stats"}

    def __init__(self, dtype: torch.dtype, trace_file: Optional[str], interval: int,
                 stats_file: Optional[str]) -> None:
        self.dtype = dtype
        self.trace_file = trace_file
        self.interval = interval
        self.stats_file = stats_file
        self.lost = LostUpdateMonitor(dtype)
        self.attempt = 0  # updates attempted, skipped ones included (restored on resume)
        self.pending_norm = None
        self.pending_stats = None
        self._started = False  # the files were started over for this run
        for path in (trace_file, stats_file):
            if path:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    @classmethod
    def from_cfg(cls, cfg, dtype: torch.dtype) -> Optional["Diagnostics"]:
        """The diagnostics the task's flags ask for, on rank 0; None when off or on another rank."""
        task = _group(cfg, "task")
        trace = getattr(task, "scale_trace", None)
        interval = int(getattr(task, "precision_stats_interval", 0) or 0)  # validated by the task
        if (not trace and not interval) or rank() != 0:
            return None
        stats_file = getattr(task, "precision_stats", None) or os.path.join(
            cfg.checkpoint.save_dir, "precision_stats.jsonl")
        return cls(dtype, trace, interval, stats_file if interval else None)

    def begin_update(self) -> None:
        """Count an attempted update; before the first one of this run, start the files over."""
        self.attempt += 1
        if not self._started:
            self._started = True
            for attr, flag in self.FLAGS.items():
                if getattr(self, attr):
                    _start_over(getattr(self, attr), self.attempt, flag)

    def note_finite(self, grad_norm: torch.Tensor, skipped: int,
                    params: Sequence[torch.Tensor]) -> None:
        """A finite update (``skipped``: the run's skipped updates): its trace record waits for
        the step; the statistics of the half ``params``' gradients when due."""
        self.pending_norm = grad_norm
        applied = self.attempt - skipped  # this update included
        if self.interval and applied % self.interval == 0:
            self.pending_stats = gradient_precision_stats(params, self.dtype)

    @staticmethod
    def _write(path: str, record: Dict[str, Any]) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _counts(self, skipped: int) -> Dict[str, int]:
        return {"update": self.attempt, "num_updates": self.attempt - skipped}

    def trace(self, grad_norm, overflow: bool, skipped: int, loss_scale: float,
              culprits=None) -> None:
        """The ``--scale-trace`` record of an update (``skipped``: the run's skipped updates,
        this one included if it overflowed)."""
        if not self.trace_file:
            return
        record = {
            # the rank that wrote it: 0 (kept for the readers of older traces, which every rank wrote)
            "rank": rank(),
            **self._counts(skipped),
            "loss_scale": loss_scale,
            "overflow": overflow,
            "skipped": overflow,
            "grad_norm": float(grad_norm) if not overflow else None,
        }
        if overflow:
            record["overflow_params"] = culprits or []
        self._write(self.trace_file, record)

    def after_step(self, skipped: int, loss_scale: float) -> None:
        """Write what waited for the step: the statistics, and the trace record."""
        if self.pending_stats is not None:
            lost = self.lost.after_step()
            stats = self.pending_stats
            self.pending_stats = None
            for layer, frac in lost.items():
                stats.setdefault(layer, {})["lost_update_frac"] = frac
            counts = self._counts(skipped)
            record = {**counts, "loss_scale": loss_scale,
                      "dtype": str(self.dtype).replace("torch.", ""), "layers": stats}
            self._write(self.stats_file, record)
            logger.info("precision stats @ num_updates %d: %s", counts["num_updates"], summarize(stats))
        if self.pending_norm is not None:
            self.trace(self.pending_norm, overflow=False, skipped=skipped, loss_scale=loss_scale)
            self.pending_norm = None


def _start_over(path: str, first: int, flag: str) -> None:
    """Keep the records of ``path`` from before update ``first`` (this run's first attempt) and
    drop the rest: all of them in a fresh run (``first`` 1), in a resumed one those written
    after its checkpoint by an earlier run. Lines that are not records (a line cut by a kill)
    go too."""
    if not os.path.exists(path):
        return
    kept: List[str] = []
    dropped = 0
    with open(path) as f:
        for line in f:
            try:
                update = json.loads(line)["update"]
            except (ValueError, KeyError, TypeError):
                update = None
            if isinstance(update, int) and update < first and line.endswith("\n"):
                kept.append(line)
            elif line.strip():
                dropped += 1
    with open(path, "w") as f:
        f.writelines(kept)
    if first == 1:
        if dropped:
            logger.info("%s %s: a new run; the %d records of an earlier run in the file are replaced",
                        flag, path, dropped)
    elif dropped:
        logger.info("%s %s: resumed at update %d; %d records from update %d on (an earlier run's, "
                    "past the checkpoint) dropped", flag, path, first, dropped, first)


def _group(cfg, name: str):
    """``cfg.<name>`` or None: fairseq's own test configurations carry only some groups."""
    try:
        return getattr(cfg, name, None)
    except Exception:  # omegaconf's missing-key errors
        return None


def summarize(stats: Dict[str, Dict]) -> str:
    """One log line: element-weighted zero/subnormal fractions, least headroom, lost updates."""
    total = sum(v.get("numel", 0) for v in stats.values()) or 1
    zero = sum(v.get("zero_frac", 0) * v.get("numel", 0) for v in stats.values()) / total
    sub = sum(v.get("subnormal_frac", 0) * v.get("numel", 0) for v in stats.values()) / total
    lost = sum(v.get("lost_update_frac", 0) * v.get("numel", 0) for v in stats.values()) / total
    tight = min(stats.items(), key=lambda kv: kv[1].get("headroom_log2", float("inf")))
    return (f"zero {zero:.2%}, subnormal {sub:.2%} of gradient elements; least headroom "
            f"{tight[1].get('headroom_log2', float('nan')):.1f} bits ({tight[0]}); "
            f"updates lost without fp32 masters {lost:.2%}")
