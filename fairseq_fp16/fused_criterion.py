"""Seam: fairseq's ``cross_entropy`` and ``label_smoothed_cross_entropy`` with the fused loss.

``--task translation_fp16`` builds these two criteria (exactly these classes, not
subclasses) as the subclasses below when the fused loss is on (``--fused-loss``).
They replace ``compute_loss`` (and label smoothing's ``compute_accuracy``, for
``--report-accuracy``), and only where fairseq's would compute
``log_softmax(net_output[0], dtype=float32)``: the model's and its
decoder's ``get_normalized_probs`` are fairseq's own and there is no adaptive
softmax. Anything else (another model's normalisation, ``reduce=False``) goes to
fairseq's methods unchanged, with one warning. The loss itself is
:func:`fairseq_fp16.core.fused_loss.label_smoothed_nll_from_logits`.

The subclasses carry their parent's class name: fairseq writes
``criterion.__class__.__name__`` into the checkpoint and refuses to resume under
another name ("Criterion does not match"), so checkpoints move freely between
fused and unfused runs, fp32 and half, and stock fairseq.
"""

import logging
from typing import Optional, Type

import torch
from fairseq.criterions import FairseqCriterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
from fairseq.models import BaseFairseqModel, FairseqDecoder
from fairseq.models.transformer import TransformerModelBase

from .core.fused_loss import PATHS, label_smoothed_nll_from_logits

logger = logging.getLogger(__name__)

__all__ = ["FUSED_LOSS_CHOICES", "fused_criterion_class", "plain_log_softmax"]

#: auto/on/off, or on with the path forced (core.fused_loss.PATHS; on picks the device's)
FUSED_LOSS_CHOICES = ("auto", "on", "off") + PATHS

# get_normalized_probs implementations that end in the decoder's plain log-softmax
_MODEL_METHODS = {BaseFairseqModel.get_normalized_probs, TransformerModelBase.get_normalized_probs}


def plain_log_softmax(model: torch.nn.Module) -> bool:
    """Whether ``model.get_normalized_probs(out, log_probs=True)`` is fairseq's
    ``log_softmax(out[0], dtype=float32)`` (distributed wrappers looked through)."""
    while not isinstance(model, BaseFairseqModel) and isinstance(
            getattr(model, "module", None), torch.nn.Module):
        model = model.module
    decoder = getattr(model, "decoder", None)
    return (
        isinstance(model, BaseFairseqModel)
        and isinstance(decoder, FairseqDecoder)
        and getattr(decoder, "adaptive_softmax", None) is None
        and type(model).get_normalized_probs in _MODEL_METHODS
        and type(model).get_normalized_probs_scriptable
        is BaseFairseqModel.get_normalized_probs_scriptable
        and type(decoder).get_normalized_probs is FairseqDecoder.get_normalized_probs
        and type(decoder).get_normalized_probs_scriptable
        is FairseqDecoder.get_normalized_probs_scriptable
    )


class _FusedLoss:
    """``compute_loss`` from the logits; fairseq's where that would change the result."""

    _warned = False
    #: one of core.fused_loss.PATHS (``--fused-loss``, or compiled with ``--compile-layers``),
    #: or None: the logits' device decides
    fused_loss_path = None

    def compute_loss(self, model, net_output, sample, reduce=True):
        if not reduce or not plain_log_softmax(model):
            if not _FusedLoss._warned:
                _FusedLoss._warned = True
                logger.warning(
                    "--fused-loss: %s; the criterion's own loss (log-softmax in fp32) is used",
                    "per-token losses were asked for (reduce=False)" if not reduce else
                    f"{type(model).__name__} does not normalise with fairseq's plain "
                    "log-softmax (an adaptive softmax or its own get_normalized_probs)")
            return super().compute_loss(model, net_output, sample, reduce=reduce)
        logits, target = self._logits_and_target(model, net_output, sample)
        loss, nll_loss = label_smoothed_nll_from_logits(
            logits.reshape(-1, logits.size(-1)), target.reshape(-1),
            float(getattr(self, "eps", 0.0)), ignore_index=self.padding_idx,
            path=self.fused_loss_path)
        return loss, nll_loss

    def _logits_and_target(self, model, net_output, sample):
        """The logits and targets that fairseq's ``get_lprobs_and_target`` pairs
        (``--ignore-prefix-size`` positions dropped), the logits not normalised."""
        logits, target = net_output[0], model.get_targets(sample, net_output)
        prefix = getattr(self, "ignore_prefix_size", 0)  # cross_entropy has none
        if prefix > 0:
            logits, target = logits[:, prefix:, :], target[:, prefix:]
        return logits, target


class FusedLabelSmoothedCrossEntropyCriterion(_FusedLoss, LabelSmoothedCrossEntropyCriterion):
    """``label_smoothed_cross_entropy`` whose loss is computed by the fused loss."""

    def compute_accuracy(self, model, net_output, sample):
        """``--report-accuracy`` from the logits: the log-softmax keeps each row's
        order, so its argmax is the logits' (fairseq's takes an fp32 log-softmax of
        the whole output first, a copy twice the half logits' size)."""
        if not plain_log_softmax(model):
            return super().compute_accuracy(model, net_output, sample)
        logits, target = self._logits_and_target(model, net_output, sample)
        with torch.no_grad():
            mask = target.ne(self.padding_idx)
            n_correct = (logits.argmax(-1).eq(target) & mask).sum()
            return n_correct, mask.sum()


class FusedCrossEntropyCriterion(_FusedLoss, CrossEntropyCriterion):
    """``cross_entropy`` whose loss is computed by the fused loss (no smoothing)."""

    def compute_loss(self, model, net_output, sample, reduce=True):
        loss, nll_loss = super().compute_loss(model, net_output, sample, reduce=reduce)
        return nll_loss, nll_loss  # fairseq's cross_entropy returns (loss, loss)


_FUSED = {
    LabelSmoothedCrossEntropyCriterion: FusedLabelSmoothedCrossEntropyCriterion,
    CrossEntropyCriterion: FusedCrossEntropyCriterion,
}
for _stock, _fused in _FUSED.items():
    _fused.__name__ = _stock.__name__  # the name fairseq's checkpoints record (module docstring)


def fused_criterion_class(criterion: FairseqCriterion) -> Optional[Type[FairseqCriterion]]:
    """The fused class standing in for ``type(criterion)``, or None if it has none."""
    return _FUSED.get(type(criterion))
