"""Pure-torch core of fairseq_fp16: loss scaling, fp32 master weights, fp32
islands, Adam, the fused loss. Nothing here imports fairseq, so it can be used and tested alone."""

from .adam import ADAM_BACKENDS, AdamWNoBiasCorrection, build_adam, split_no_decay
from .fused_loss import label_smoothed_nll_from_logits
from .fp32_islands import apply_fp32_islands, is_fp32_island, keep_in_fp32
from .loss_scaler import LossScaler, parse_loss_scale
from .master_weights import HALF_DTYPES, MixedPrecisionOptimizer, param_name, tag_param_names

__all__ = [
    "ADAM_BACKENDS",
    "AdamWNoBiasCorrection",
    "HALF_DTYPES",
    "LossScaler",
    "MixedPrecisionOptimizer",
    "apply_fp32_islands",
    "build_adam",
    "is_fp32_island",
    "keep_in_fp32",
    "label_smoothed_nll_from_logits",
    "param_name",
    "parse_loss_scale",
    "split_no_decay",
    "tag_param_names",
]
