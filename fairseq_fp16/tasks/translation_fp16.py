"""``--task translation_fp16``: fairseq's translation task, built for half precision.

What it adds to ``translation``:

* fp32 islands: every LayerNorm/GroupNorm/BatchNorm, and the modules matching
  ``--fp32-modules REGEX``, keep fp32 parameters and compute in fp32 after the
  trainer casts the model with ``--fp16``/``--bf16``;
* attention softmax in fp32 (``--attention-path``): on CUDA the self-attention
  layers take torch's fused ``multi_head_attention_forward``, whose
  scaled-dot-product kernels accumulate the softmax in fp32 and store no
  probabilities; for CPU half runs each ``MultiheadAttention`` takes fairseq's
  own path, whose softmax is computed in fp32 (``utils.softmax(...,
  dtype=float32)``) and whose products the fp32-accumulate mode routes;
  the output log-softmax (``utils.log_softmax``) and the criterion are fp32
  already in fairseq;
* ``--compile-layers``: each encoder and decoder layer's training forward
  compiled with ``torch.compile`` (:mod:`fairseq_fp16.core.compile`);
* the loss-scaling flags ``--loss-scale`` and ``--loss-scale-hysteresis``,
  validated when the task is set up, and ``--max-consecutive-overflows``
  (stop a run that cannot heal, naming the first non-finite module);
* ``--half-matmul``: on CPUs without half-precision units, the train step,
  valid step and generation run their matrix products with fp32 accumulation
  (:mod:`fairseq_fp16.core.half_matmul`);
* ``--cpu-length-multiple`` and ``--cpu-kernel-cache``: for CPU half runs on
  native kernels, pad batch lengths so that batches come in few shapes (by
  default where the products run on AMX tiles, whose kernels oneDNN compiles per
  shape), and cap oneDNN's per-shape kernel caches, whose memory otherwise grows
  with every batch shape (:mod:`fairseq_fp16.core.cpu_kernel_cache`); generation
  drops the padded source columns again, so decoding is as without padding;
* the diagnostics flags ``--scale-trace``, ``--precision-stats-interval`` and
  ``--precision-stats`` (read by the mixed-precision optimizer), and
  ``--precision-divergence-interval``/``--precision-divergence``: each module's
  forward output in half against fp32 (:mod:`fairseq_fp16.core.divergence`),
  measured here before the training step; the first training and generation steps
  under fp32 accumulation log the half products left on native kernels;
* ``--fused-loss``: ``cross_entropy`` and ``label_smoothed_cross_entropy`` take
  their fp32 loss from the half logits chunk by chunk instead of through an fp32
  copy of the log-probabilities (:mod:`fairseq_fp16.fused_criterion`);
* ``fairseq-generate --bf16`` casts the models to bf16 (stock fairseq-generate
  only knows ``--fp16``);
* ``--no-repeat-ngram-size`` off CUDA: fairseq's fallback for its CUDA kernel
  blocks nothing; the generator gets :class:`~fairseq_fp16.core.ngram_block.NGramBlock`
  instead, which blocks every repeated n-gram;
* resume reproducibility: fairseq(-fixed) 0.12.3 orders the examples under
  ``numpy_seed(seed + epoch)`` with the epoch in which the batch iterator is
  *created*, and reuses those batches for every later epoch. An uninterrupted
  run creates it in epoch 1; a run resumed in epoch 2 or later re-creates it
  with another seed and trains on differently composed batches. This task
  always orders the examples with the epoch-1 seed, so a resumed run sees the
  batches the uninterrupted run would have seen.
"""


import json
import logging
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import wraps
from typing import Optional

import torch
from fairseq.data import data_utils
from fairseq.dataclass import ChoiceEnum
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask
from omegaconf import II

from ..core.compile import compile_training_forward
from ..core.cpu_kernel_cache import (
    cap_cpu_kernel_caches,
    resolve_kernel_cache,
    resolve_length_multiple,
)
from ..core.divergence import forward_divergence, summarize_divergence
from ..core.fp32_islands import apply_fp32_islands
from ..core.half_matmul import (
    HALF_MATMUL_CHOICES,
    NativeHalfProducts,
    half_matmul_context,
    resolve_half_matmul,
)
from ..core.loss_scaler import parse_loss_scale
from ..core.master_weights import tag_param_names
from ..core.ngram_block import NGramBlock
from ..fused_criterion import FUSED_LOSS_CHOICES, fused_criterion_class

logger = logging.getLogger(__name__)

__all__ = ["ATTENTION_PATHS", "TranslationFP16Config", "TranslationFP16Task", "avoid_cudnn_attention",
           "drop_pad_columns",
           "resolve_attention_path", "validate_precision_flags"]

ATTENTION_PATHS = ("auto", "torch", "fairseq")


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
    max_consecutive_overflows: int = field(
        default=10,
        metadata={
            "help": "stop the run, naming the first module whose forward output is not finite, "
            "after this many updates in a row were skipped for overflows that a smaller scale "
            "cannot fix (a non-finite loss; any overflow under a static scale). 0 = never; "
            "--min-loss-scale still applies"
        },
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
    fused_loss: ChoiceEnum(list(FUSED_LOSS_CHOICES)) = field(  # type: ignore[valid-type]
        default="auto",
        metadata={
            "help": "cross_entropy and label_smoothed_cross_entropy computed from the logits "
            "in fp32 chunks, keeping no fp32 log-probabilities for the backward pass (apex "
            "xentropy's role): the same loss, a fraction of its memory. auto: on for --fp16/"
            "--bf16, off for fp32 (fairseq's own loss)"
        },
    )
    cpu_kernel_cache: str = field(
        default="auto",
        metadata={
            "help": "CPU half runs with native kernels: oneDNN keeps a compiled kernel per "
            "matrix shape in two caches (torch's default: 1024 each), and a run's memory grows "
            "with every batch shape until they are full; this caps both. auto: 1024 when batch "
            "lengths are padded (--cpu-length-multiple; few shapes), else 64. Sets "
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY and LRU_CACHE_CAPACITY unless already set"
        },
    )
    cpu_length_multiple: str = field(
        default="auto",
        metadata={
            "help": "CPU half runs with native kernels: pad each batch's source and target "
            "lengths to a multiple of this (as --required-seq-len-multiple; the padding is "
            "masked), so that batches come in few shapes and oneDNN compiles each shape's "
            "kernel once. auto: 8 where the half products run on AMX tiles (bf16: amx_bf16, "
            "fp16: amx_fp16), else 1 (lengths as they are). A --required-seq-len-multiple "
            "above 1 wins; fp32 runs are never padded by this flag"
        },
    )
    attention_path: ChoiceEnum(list(ATTENTION_PATHS)) = field(  # type: ignore[valid-type]
        default="auto",
        metadata={
            "help": "multi-head attention: torch = torch's fused multi_head_attention_forward (on "
            "CUDA its scaled-dot-product kernels, softmax accumulated in fp32 inside, no stored "
            "probabilities; fairseq sends encoder-decoder attention down its own path anyway); "
            "fairseq = fairseq's own attention, softmax in fp32, B*H*T^2 probabilities kept for "
            "the backward. auto: fairseq for half-precision runs on the CPU, else torch"
        },
    )
    compile_layers: bool = field(
        default=False,
        metadata={
            "help": "compile each encoder and decoder layer's training forward with torch.compile "
            "(dynamic shapes): the elementwise work fuses and far fewer kernels are launched. The "
            "first updates pay the compile time; validation and generation run eagerly"
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
    precision_divergence_interval: int = field(
        default=0,
        metadata={"help": "every N updates (and before the first): each module's forward output "
                  "in half precision against the same model holding the fp32 master weights, as a "
                  "relative error, on the update's batch in eval mode (0 = off)"},
    )
    precision_divergence: Optional[str] = field(
        default=None,
        metadata={"help": "JSONL file for --precision-divergence-interval "
                  "(default: SAVE_DIR/precision_divergence.jsonl)"},
    )
    fp16: bool = II("common.fp16")
    bf16: bool = II("common.bf16")
    cpu: bool = II("common.cpu")
    save_dir: str = II("checkpoint.save_dir")


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
    if cfg.max_consecutive_overflows is None or int(cfg.max_consecutive_overflows) < 0:
        raise ValueError(
            "--max-consecutive-overflows must be an integer >= 0 (0 = never stop), "
            f"got {cfg.max_consecutive_overflows!r}"
        )
    if cfg.fp32_modules:
        try:
            re.compile(cfg.fp32_modules)
        except re.error as e:
            raise ValueError(
                f"--fp32-modules is not a valid regular expression: {cfg.fp32_modules!r} ({e})"
            ) from None
    for flag in ("precision_stats_interval", "precision_divergence_interval"):
        value = getattr(cfg, flag, 0)
        if value is not None and int(value) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0 (0 = off), got {value!r}")
    resolve_length_multiple(cfg.cpu_length_multiple, None, native=False)
    resolve_attention_path(str(getattr(cfg, "attention_path", "auto")), False, False)
    resolve_kernel_cache(cfg.cpu_kernel_cache, 1)
    if getattr(cfg, "bf16", False) and scale:
        logger.warning(
            "--loss-scale %s with --bf16: bf16 has fp32's exponent range and needs no "
            "loss scaling; the scale is applied anyway", cfg.loss_scale,
        )


def resolve_attention_path(choice: str, half: bool, on_cpu: bool) -> str:
    """'torch' or 'fairseq': which attention ``--attention-path CHOICE`` selects.

    auto keeps fairseq's own attention for half-precision runs on the CPU, where the
    fp32-accumulate products route its matrix products and torch's CPU kernels would run
    the softmax in half; everywhere else it is torch's fused path (stock fairseq's choice).

    Raises:
        ValueError: naming the flag and its choices.
    """
    if choice not in ATTENTION_PATHS:
        raise ValueError(f"--attention-path must be one of {', '.join(ATTENTION_PATHS)}, "
                         f"got {choice!r}")
    if choice != "auto":
        return choice
    return "fairseq" if half and on_cpu else "torch"


def avoid_cudnn_attention() -> bool:
    """Take cuDNN out of torch's scaled-dot-product attention backends (process-wide).

    torch (2.5 and later) tries cuDNN's attention first for half-precision inputs on Hopper
    and newer GPUs, and cuDNN builds an execution plan for every new input shape: tens to
    hundreds of milliseconds of host time each. fairseq's batches change shape (sentences x
    length) nearly every update, so each update paid plan builds; flash and memory-efficient
    attention need none. Returns whether it was on.
    """
    backends = torch.backends.cuda
    if not getattr(backends, "cudnn_sdp_enabled", lambda: False)():
        return False
    backends.enable_cudnn_sdp(False)
    logger.info("attention: cuDNN's scaled-dot-product kernels off (they build a plan for every "
                "new batch shape); torch's flash and memory-efficient kernels serve")
    return True


def drop_pad_columns(sample: dict, pad: int) -> dict:
    """The sample with the source columns that hold only padding removed: the batch as fairseq
    collates it without ``--required-seq-len-multiple``. A shallow copy; ``sample`` is unchanged.

    Generation takes it: fairseq's beam search caps a batch's output length at
    ``max_len_a * source columns + max_len_b``, so padded columns would loosen the cap.
    """
    src = sample["net_input"]["src_tokens"]
    keep = src.ne(pad).any(0)
    if bool(keep.all()):
        return sample
    return dict(sample, net_input=dict(sample["net_input"], src_tokens=src[:, keep]))


@register_task("translation_fp16", dataclass=TranslationFP16Config)
class TranslationFP16Task(TranslationTask):
    """Translation with fp32 islands and loss-scaling flags for --fp16/--bf16."""

    cfg: TranslationFP16Config
    #: the multiple --cpu-length-multiple padded batch lengths to (1: not padded by it)
    _length_multiple = 1

    def __init__(self, cfg: TranslationFP16Config, src_dict, tgt_dict):
        validate_precision_flags(cfg)
        super().__init__(cfg, src_dict, tgt_dict)
        dtype = self.half_dtype
        on_cpu = bool(getattr(cfg, "cpu", False)) or not torch.cuda.is_available()
        self.fp32_accumulate = on_cpu and resolve_half_matmul(str(cfg.half_matmul), dtype)
        self._checked_steps = set()  # steps whose native half products were counted
        self._divergence_done = None  # the update whose forward divergence was measured
        if dtype is not None and on_cpu:
            logger.info(
                "CPU %s matrix products: %s (--half-matmul %s)",
                "fp16" if dtype == torch.float16 else "bf16",
                "fp32 accumulation, rounded to half" if self.fp32_accumulate else "native kernels",
                cfg.half_matmul,
            )
            if not self.fp32_accumulate:
                self._bucket_cpu_shapes(dtype)

    def _bucket_cpu_shapes(self, dtype: torch.dtype) -> None:
        """Native CPU half products: pad batch lengths (``--cpu-length-multiple``) and
        bound oneDNN's per-shape kernel caches (``--cpu-kernel-cache``)."""
        cfg = self.cfg
        multiple = resolve_length_multiple(cfg.cpu_length_multiple, dtype, native=True)
        given = int(getattr(cfg, "required_seq_len_multiple", 1) or 1)
        if given > 1:
            logger.info("CPU batch lengths: padded to a multiple of %d (--required-seq-len-multiple; "
                        "--cpu-length-multiple %s not applied)", given, cfg.cpu_length_multiple)
        elif multiple > 1:  # set on each dataset (load_dataset), not in the cfg checkpoints save
            self._length_multiple = multiple
            logger.info("CPU batch lengths: padded to a multiple of %d (--cpu-length-multiple %s; "
                        "the padding is masked)", multiple, cfg.cpu_length_multiple)
        capacity = resolve_kernel_cache(cfg.cpu_kernel_cache, max(given, multiple))
        caps = cap_cpu_kernel_caches(capacity)
        logger.info(
            "CPU kernel caches: %s (--cpu-kernel-cache %s; a variable set in the "
            "environment wins)", ", ".join(f"{k}={v}" for k, v in caps.items()),
            cfg.cpu_kernel_cache,
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

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        super().load_dataset(split, epoch=epoch, combine=combine, **kwargs)
        if self._length_multiple > 1:
            dataset = self.datasets[split]
            if not hasattr(dataset, "pad_to_multiple"):
                raise RuntimeError(
                    f"--cpu-length-multiple: fairseq's {type(dataset).__name__} has no "
                    "pad_to_multiple (changed fairseq?); pass --cpu-length-multiple 1"
                )
            dataset.pad_to_multiple = self._length_multiple  # what its collater pads to

    # The CPU matmul mode is active exactly during these three steps.
    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        with half_matmul_context(self.fp32_accumulate):
            if self._divergence_due(sample, optimizer, update_num, ignore_grad):
                self._measure_divergence(sample, model, optimizer, update_num)
            with self._native_products_check("training step"):
                return super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad)

    def valid_step(self, *args, **kwargs):
        with half_matmul_context(self.fp32_accumulate):
            return super().valid_step(*args, **kwargs)

    def inference_step(self, generator, models, sample, *args, **kwargs):
        if self._length_multiple > 1:  # the beam's length limit counts source columns
            sample = drop_pad_columns(sample, self.source_dictionary.pad())
        with half_matmul_context(self.fp32_accumulate), self._native_products_check("generation step"):
            return super().inference_step(generator, models, sample, *args, **kwargs)

    def _divergence_due(self, sample, optimizer, update_num, ignore_grad) -> bool:
        interval = int(self.cfg.precision_divergence_interval or 0)
        if (not interval or update_num % interval or update_num == self._divergence_done
                or ignore_grad or not sample or "net_input" not in sample
                or (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0)):
            return False
        if getattr(optimizer, "core", None) is None:  # no plugin masters to compare against
            if self._divergence_done is None:
                logger.warning("--precision-divergence-interval: this run has no fp32 master "
                               "weights of the plugin's (an fp32 run, or an optimizer other than "
                               "fp16_adam); nothing is measured")
                self._divergence_done = -1
            return False
        return True

    def _measure_divergence(self, sample, model, optimizer, update_num) -> None:
        """The forward divergence of this update's batch (first micro-batch), logged and
        appended to the JSONL file."""
        self._divergence_done = update_num
        errors = forward_divergence(model, optimizer.core.masters_by_param(), sample["net_input"])
        path = self.cfg.precision_divergence or os.path.join(self.cfg.save_dir,
                                                             "precision_divergence.jsonl")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        record = {"update": update_num, "dtype": str(self.half_dtype).replace("torch.", ""),
                  "modules": errors}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        logger.info("forward divergence @ update %d (relative to fp32): %s", update_num,
                    summarize_divergence(errors))

    @contextmanager
    def _native_products_check(self, step: str):
        """The first training (generation) step under fp32 accumulation counts the half
        products that escaped it: functions the mode does not route run torch's native
        half kernels, tens of times slower than fp32 on such a CPU. Logs what it found."""
        if not self.fp32_accumulate or step in self._checked_steps:
            yield
            return
        self._checked_steps.add(step)
        with NativeHalfProducts() as check:
            yield
        if check.counts:
            logger.warning(
                "--half-matmul: %d half-precision matrix products of the first %s ran on torch's "
                "native half kernels (on a CPU without half-precision units many times slower "
                "than fp32): %s. The functions that issue them are not routed to fp32 "
                "accumulation (ROUTED_FUNCTIONS in fairseq_fp16/core/half_matmul.py)",
                sum(check.counts.values()), step, check.summary())
        else:
            logger.info("--half-matmul: every half-precision matrix product of the first %s "
                        "accumulated in fp32", step)

    def get_batch_iterator(self, dataset, *args, **kwargs):
        """fairseq's iterator, with examples ordered as in epoch 1 (see the module docstring)."""
        if getattr(self.cfg, "rebuild_batches", False):  # batches re-made every epoch by design
            return super().get_batch_iterator(dataset, *args, **kwargs)
        seed = kwargs.get("seed", args[5] if len(args) > 5 else 1)
        ordered_indices = dataset.ordered_indices
        own = vars(dataset).get("ordered_indices")

        @wraps(ordered_indices)
        def first_epoch_order():
            with data_utils.numpy_seed(seed + 1):
                return ordered_indices()

        dataset.ordered_indices = first_epoch_order
        try:
            return super().get_batch_iterator(dataset, *args, **kwargs)
        finally:
            if own is None:
                del dataset.ordered_indices
            else:
                dataset.ordered_indices = own

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
        on_cpu = bool(getattr(self.cfg, "cpu", False)) or not torch.cuda.is_available()
        choice = str(getattr(self.cfg, "attention_path", "auto"))  # absent in older configs
        path = resolve_attention_path(choice, self.half_precision, on_cpu)
        attentions = [m for m in model.modules() if isinstance(m, MultiheadAttention)]
        if path == "fairseq":
            for module in attentions:
                module._set_skip_embed_dim_check()  # fairseq's own path, with its fp32 softmax
        if path == "torch" and self.half_precision and not on_cpu and attentions:
            avoid_cudnn_attention()
        if attentions:
            logger.info("attention: %s (--attention-path %s)", "fairseq's own, softmax in fp32"
                        if path == "fairseq" else "torch's fused multi_head_attention_forward",
                        choice)
        if getattr(self.cfg, "compile_layers", False):
            layers = [m for m in model.modules()
                      if isinstance(m, (TransformerEncoderLayerBase, TransformerDecoderLayerBase))]
            if not layers:
                raise ValueError(f"--compile-layers: {type(model).__name__} has no transformer "
                                 "encoder or decoder layers to compile")
            compile_training_forward(layers)
            logger.info("--compile-layers: the training forward of %d transformer layers is "
                        "compiled (torch.compile, dynamic shapes)", len(layers))
        return model

    def build_criterion(self, cfg, from_checkpoint=False):
        criterion = super().build_criterion(cfg, from_checkpoint)
        mode = str(self.cfg.fused_loss)
        if mode == "off" or (mode == "auto" and not self.half_precision):
            return criterion
        fused = fused_criterion_class(criterion)
        if fused is None:
            (logger.warning if mode == "on" else logger.info)(
                "--fused-loss %s: the criterion %s has no fused loss (only cross_entropy and "
                "label_smoothed_cross_entropy); its own is used", mode, type(criterion).__name__)
            return criterion
        logger.info("--fused-loss %s: %s computes its loss from the logits in fp32 chunks, "
                    "keeping no fp32 log-probabilities", mode,
                    getattr(cfg, "_name", None) or type(criterion).__name__)
        return fused.build_criterion(cfg, self)

    def build_generator(self, models, args, **kwargs):
        if getattr(self.cfg, "bf16", False):
            for model in models:
                model.to(torch.bfloat16)  # fp32 islands stay fp32
        generator = super().build_generator(models, args, **kwargs)
        blocker = getattr(generator, "repeat_ngram_blocker", None)
        if blocker is not None and not getattr(blocker, "use_extension", True):
            # fairseq's fallback off its CUDA kernel blocks nothing (fairseq issue #5206)
            generator.repeat_ngram_blocker = NGramBlock(blocker.no_repeat_ngram_size)
            logger.info("--no-repeat-ngram-size %d: repeats blocked by the plugin's NGramBlock "
                        "(fairseq's fallback off its CUDA kernel blocks none)",
                        blocker.no_repeat_ngram_size)
        return generator
