"""``--task translation_fp16``: fairseq's translation task, built for half precision.

What it adds to ``translation``:

* fp32 islands: every LayerNorm/GroupNorm/BatchNorm, and the modules matching
  ``--fp32-modules REGEX``, keep fp32 parameters and compute in fp32 after the
  trainer casts the model with ``--fp16``/``--bf16``;
* attention softmax in fp32: under half precision each ``MultiheadAttention``
  takes fairseq's own attention path, whose softmax is computed in fp32
  (``utils.softmax(..., dtype=float32)``), instead of PyTorch's fused
  ``multi_head_attention_forward``, whose softmax runs in the input dtype;
  the output log-softmax (``utils.log_softmax``) and the criterion are fp32
  already in fairseq;
* the loss-scaling flags ``--loss-scale`` and ``--loss-scale-hysteresis``,
  validated when the task is set up;
* ``--half-matmul``: on CPUs without half-precision units, the train step,
  valid step and generation run their matrix products with fp32 accumulation
  (:mod:`fairseq_fp16.core.half_matmul`);
* the diagnostics flags ``--scale-trace``, ``--precision-stats-interval`` and
  ``--precision-stats`` (read by the mixed-precision optimizer);
* ``fairseq-generate --bf16`` casts the models to bf16 (stock fairseq-generate
  only knows ``--fp16``).
"""


import logging
import re
from dataclasses import dataclass, field
from typing import Optional

import torch
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask
from omegaconf import II

from ..core.fp32_islands import apply_fp32_islands
from ..core.half_matmul import HALF_MATMUL_CHOICES, half_matmul_context, resolve_half_matmul
from ..core.loss_scaler import parse_loss_scale
from ..core.master_weights import tag_param_names

logger = logging.getLogger(__name__)

__all__ = ["TranslationFP16Config", "TranslationFP16Task", "validate_precision_flags"]


@dataclass
class TranslationFP16Config(TranslationConfig):
    loss_scale: Optional[str] = field(
        default=None,
        metadata={
            "help": "0: dynamic loss scaling; a positive power of two: static scale. "
            "Default: dynamic for --fp16, none for --bf16"
        },
    )
    loss_scale_hysteresis: int = field(
        default=1,
        metadata={"help": "overflows absorbed before the dynamic scale backs off (1 = every one)"},
    )
    fp32_modules: Optional[str] = field(
        default=None,
        metadata={
            "help": "regular expression on module names (e.g. 'output_projection|embed'): "
            "matching modules keep fp32 weights and arithmetic; norms always do"
        },
    )
    half_matmul: ChoiceEnum(list(HALF_MATMUL_CHOICES)) = field(  # type: ignore[valid-type]
        default="auto",
        metadata={
            "help": "CPU matrix products of a half model: fp32-accumulate upcasts operands, "
            "multiplies in fp32 and rounds to half (a GPU tensor core's numerics, at fp32 "
            "speed); native uses torch's half kernels; auto picks fp32-accumulate when the "
            "CPU has no units for the dtype. CUDA is never affected"
        },
    )
    scale_trace: Optional[str] = field(
        default=None,
        metadata={"help": "JSONL file: one line per update (scale, overflow, skipped, grad norm, "
                  "the parameters that overflowed)"},
    )
    precision_stats_interval: int = field(
        default=0,
        metadata={"help": "every N updates: per-layer zero/subnormal gradient fractions, headroom "
                  "and lost-update fraction (0 = off)"},
    )
    precision_stats: Optional[str] = field(
        default=None,
        metadata={"help": "JSONL file for --precision-stats-interval "
                  "(default: SAVE_DIR/precision_stats.jsonl)"},
    )
    fp16: bool = II("common.fp16")
    bf16: bool = II("common.bf16")
    cpu: bool = II("common.cpu")


def validate_precision_flags(cfg) -> None:
    """Refuse bad precision flags before any data or model is loaded.

    Raises:
        ValueError: naming the flag and its valid values.
    """
    if getattr(cfg, "fp16", False) and getattr(cfg, "bf16", False):
        raise ValueError("--fp16 and --bf16 are exclusive: pick one precision")
    scale = parse_loss_scale(cfg.loss_scale)
    if cfg.loss_scale_hysteresis is None or int(cfg.loss_scale_hysteresis) < 1:
        raise ValueError(
            "--loss-scale-hysteresis must be an integer >= 1 (1 backs off at every "
            f"overflow), got {cfg.loss_scale_hysteresis!r}"
        )
    if cfg.fp32_modules:
        try:
            re.compile(cfg.fp32_modules)
        except re.error as e:
            raise ValueError(
                f"--fp32-modules is not a valid regular expression: {cfg.fp32_modules!r} ({e})"
            ) from None
    if cfg.precision_stats_interval is not None and int(cfg.precision_stats_interval) < 0:
        raise ValueError(
            "--precision-stats-interval must be >= 0 (0 = off), "
            f"got {cfg.precision_stats_interval!r}"
        )
    if getattr(cfg, "bf16", False) and scale:
        logger.warning(
            "--loss-scale %s with --bf16: bf16 has fp32's exponent range and needs no "
            "loss scaling; the scale is applied anyway", cfg.loss_scale,
        )


@register_task("translation_fp16", dataclass=TranslationFP16Config)
class TranslationFP16Task(TranslationTask):
    """Translation with fp32 islands and loss-scaling flags for --fp16/--bf16."""

    cfg: TranslationFP16Config

    def __init__(self, cfg: TranslationFP16Config, src_dict, tgt_dict):
        validate_precision_flags(cfg)
        super().__init__(cfg, src_dict, tgt_dict)
        dtype = self.half_dtype
        on_cpu = bool(getattr(cfg, "cpu", False)) or not torch.cuda.is_available()
        self.fp32_accumulate = on_cpu and resolve_half_matmul(str(cfg.half_matmul), dtype)
        if dtype is not None and on_cpu:
            logger.info(
                "CPU %s matrix products: %s (--half-matmul %s)",
                "fp16" if dtype == torch.float16 else "bf16",
                "fp32 accumulation, rounded to half" if self.fp32_accumulate else "native kernels",
                cfg.half_matmul,
            )

    @property
    def half_dtype(self) -> Optional[torch.dtype]:
        if getattr(self.cfg, "fp16", False):
            return torch.float16
        if getattr(self.cfg, "bf16", False):
            return torch.bfloat16
        return None

    @property
    def half_precision(self) -> bool:
        return self.half_dtype is not None

    # The CPU matmul mode is active exactly during these three steps.
    def train_step(self, *args, **kwargs):
        with half_matmul_context(self.fp32_accumulate):
            return super().train_step(*args, **kwargs)

    def valid_step(self, *args, **kwargs):
        with half_matmul_context(self.fp32_accumulate):
            return super().valid_step(*args, **kwargs)

    def inference_step(self, *args, **kwargs):
        with half_matmul_context(self.fp32_accumulate):
            return super().inference_step(*args, **kwargs)

    def build_model(self, cfg, from_checkpoint=False):
        model = super().build_model(cfg, from_checkpoint)
        tag_param_names(model.named_parameters())
        matched = apply_fp32_islands(model, self.cfg.fp32_modules)
        if self.cfg.fp32_modules:
            if matched:
                logger.info("fp32 modules (--fp32-modules): %s", ", ".join(matched))
            else:
                logger.warning(
                    "--fp32-modules %r matched no module name; names look like %s",
                    self.cfg.fp32_modules,
                    ", ".join(n for n, _ in list(model.named_modules())[1:4]),
                )
        if self.half_precision:
            for module in model.modules():
                if isinstance(module, MultiheadAttention):
                    # Takes fairseq's attention path, with its fp32 softmax.
                    module._set_skip_embed_dim_check()
        return model

    def build_generator(self, models, args, **kwargs):
        if getattr(self.cfg, "bf16", False):
            for model in models:
                model.to(torch.bfloat16)  # fp32 islands stay fp32
        return super().build_generator(models, args, **kwargs)
