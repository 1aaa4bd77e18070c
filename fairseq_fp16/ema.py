"""``--ema-fp32`` in a half run: fairseq's EMA of the fp32 master weights.

fairseq's trainer keeps an EMA of the model (``--store-ema``); with ``--ema-fp32`` it keeps the
average in fp32, but of what the model holds: the half weights, each update's rounding
included. :class:`MastersEMA`, which the patched trainer builds (:mod:`fairseq_fp16.patches.trainer`),
averages the optimizer wrapper's fp32 masters instead; :func:`rebuild_ema_model` makes a resumed
run's EMA model from the fp32 EMA it loaded (:mod:`fairseq_fp16.patches.checkpoints`).
"""

from __future__ import annotations

from typing import Optional

from fairseq.models.ema import EMA

from .optim.mixed_precision import MixedPrecisionFairseqOptimizer

__all__ = ["MastersEMA", "rebuild_ema_model"]


class _MastersView:
    """What the EMA reads of the model: its state dict with each half weight's fp32 master.

    Keys are matched to masters through the parameter they hold, so a tied weight (shared
    embeddings: one parameter under several keys) reads its master under every key. The
    masters are handed over detached: fairseq's EMA step runs outside ``no_grad``, and its
    in-place updates from a tensor that requires grad would record an autograd graph in the
    EMA's tensors, two nodes a tensor every update, that nothing frees.
    """

    def __init__(self, model, masters_by_param) -> None:
        self._model, self._masters = model, masters_by_param

    def state_dict(self):
        return {k: self._masters.get(id(v), v).detach()
                for k, v in self._model.state_dict(keep_vars=True).items()}


class MastersEMA(EMA):
    """fairseq's EMA; with ``--ema-fp32`` in a half run it averages the fp32 masters of the
    optimizer wrapper it follows, not the model's rounded half weights."""

    def __init__(self, model, config, device=None, skip_keys=None) -> None:
        super().__init__(model, config, device=device, skip_keys=skip_keys)
        self.optimizer: Optional[MixedPrecisionFairseqOptimizer] = None

    def follow(self, optimizer: MixedPrecisionFairseqOptimizer) -> None:
        """Average ``optimizer``'s masters from now on (the trainer calls this as it builds it)."""
        self.optimizer = optimizer

    def step(self, new_model, updates=None):
        masters = self.optimizer.masters_by_param() if self.optimizer is not None else {}
        if self.config.ema_fp32 and masters:
            new_model = _MastersView(new_model, masters)
        return super().step(new_model, updates)


def rebuild_ema_model(trainer, extra_state) -> None:
    """With ``--ema-fp32``, fairseq loads the EMA model from the checkpoint's EMA model (in the
    writer's dtype) and the fp32 EMA beside it: a run in another half dtype holds the EMA model
    rounded twice until the next EMA update rebuilds it from the fp32 EMA. It is rebuilt now,
    as that update would."""
    ema = trainer.cfg.ema
    if extra_state and ema.store_ema and ema.ema_fp32 and "ema_fp32_params" in extra_state:
        trainer.ema.restore(dict(trainer.ema.fp32_params), build_fp32_params=False)
