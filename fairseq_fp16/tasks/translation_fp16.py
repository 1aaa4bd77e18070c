"""``--task translation_fp16``: fairseq's translation task with the plugin's flags.

The precision features work for every task (:mod:`fairseq_fp16.patches.tasks`: fp32
islands, attention path, fused loss, the CPU matrix-product mode, diagnostics); this task
declares their flags, so that a translation run can set them, and adds what is about
translation data:

* the flags: loss scaling (``--loss-scale``, ``--loss-scale-hysteresis``,
  ``--max-consecutive-overflows``), ``--fp32-modules``, ``--half-matmul``, ``--fused-loss``,
  ``--attention-path``, ``--compile-layers``, ``--length-buckets``, ``--cuda-graphs`` and the
  diagnostics (``--scale-trace``, ``--precision-stats-interval``/``--precision-stats``,
  ``--precision-divergence-interval``/``--precision-divergence``), validated before any data
  is read;
* ``--cpu-length-multiple`` and ``--cpu-kernel-cache``: CPU half runs on native kernels pad
  each batch's lengths so that batches come in few shapes, and cap oneDNN's per-shape
  kernel caches (:mod:`fairseq_fp16.core.cpu_kernel_cache`); generation drops the padded
  source columns again, so decoding is as without padding;
* resumed runs train on the batches an uninterrupted run would: fairseq(-fixed) 0.12.3 orders
  the examples under ``numpy_seed(seed + epoch)`` with the epoch in which the batch iterator
  is created, and reuses those batches in later epochs, so a run resumed in epoch 2 or later
  would see differently composed batches; this task orders them with the epoch-1 seed.
"""


import logging
import os
import re
from dataclasses import dataclass, field
from functools import wraps
from typing import Optional

import torch
from fairseq.data import data_utils
from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask
from omegaconf import II

from ..core.cpu_kernel_cache import (
    cap_cpu_kernel_caches,
    resolve_kernel_cache,
    resolve_length_multiple,
)
from ..core.buckets import parse_length_buckets
from ..core.half_matmul import HALF_MATMUL_CHOICES
from ..core.loss_scaler import parse_loss_scale
from ..fused_criterion import FUSED_LOSS_CHOICES
from ..patches.tasks import ATTENTION_PATHS, SEED_POSITION, resolve_attention_path, task_state
from ..precision import EXCLUSIVE
from .. import run_info

logger = logging.getLogger(__name__)

__all__ = ["TranslationFP16Config", "TranslationFP16Task", "drop_pad_columns", "validate_precision_flags"]


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
            "--bf16, off for fp32 (fairseq's own loss). on works in large chunks with few "
            "passes over memory on CUDA (stream) and in cache-sized chunks on the CPU (cache), "
            "or, with --compile-layers, in kernels made by torch.compile (compiled); stream, "
            "cache or compiled turns it on with that path on any device"
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
    length_buckets: str = field(
        default="off",
        metadata={
            "help": "training batches in at most N shapes (auto: the count of 1 to 16 that pads "
            "least): source and target lengths padded up to buckets fitted to the training data, "
            "and the sentences per batch fixed per bucket (at most --max-tokens // the bucket's "
            "longer side, spread evenly over its batches; places left over hold padding "
            "sentences, which add no loss and no gradient). What --cuda-graphs needs; off: "
            "fairseq's batches"
        },
    )
    cuda_graphs: bool = field(
        default=False,
        metadata={
            "help": "run the compiled layers (--compile-layers) as CUDA graphs (torch.compile's "
            "reduce-overhead mode): a graph recorded for each batch shape and replayed, a layer's "
            "kernels launched at once. Needs --length-buckets; off CUDA the layers run compiled "
            "without graphs"
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
    fp16_init_scale: int = II("common.fp16_init_scale")  # fairseq's flags, validated here
    fp16_scale_window: Optional[int] = II("common.fp16_scale_window")
    cpu: bool = II("common.cpu")
    save_dir: str = II("checkpoint.save_dir")


def validate_precision_flags(cfg) -> None:
    """Refuse bad precision flags before any data or model is loaded.

    Raises:
        ValueError: naming the flag and its valid values.
    """
    if getattr(cfg, "fp16", False) and getattr(cfg, "bf16", False):
        raise ValueError(EXCLUSIVE)
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
    _validate_loss_scale_flags(cfg)
    _validate_diagnostics_flags(cfg)
    resolve_length_multiple(cfg.cpu_length_multiple, None, native=False)
    resolve_attention_path(str(getattr(cfg, "attention_path", "auto")), False, False)
    resolve_kernel_cache(cfg.cpu_kernel_cache, 1)
    _validate_batch_shape_flags(cfg)
    if getattr(cfg, "bf16", False) and scale:
        logger.warning(
            "--loss-scale %s with --bf16: bf16 has fp32's exponent range and needs no "
            "loss scaling; the scale is applied anyway", cfg.loss_scale,
        )


def _flag(cfg, name: str, default=None):
    """``cfg.<name>``, or ``default`` where the configuration lacks it or cannot resolve it (a
    task built from an older checkpoint's configuration, or without fairseq's ``common``)."""
    try:
        value = getattr(cfg, name, default)
    except Exception:  # omegaconf: an interpolation with nothing to point at
        return default
    if value is None or (isinstance(value, str) and value.startswith("${")):  # a bare dataclass
        return default
    return value


def _validate_loss_scale_flags(cfg) -> None:
    """fairseq's ``--fp16-init-scale`` and ``--fp16-scale-window``, which fairseq takes as they
    come: 0 fails only when the scaler is built (or, in fairseq's own scaler, at the first
    scale update)."""
    init = _flag(cfg, "fp16_init_scale")
    if init is not None and not float(init) >= 1:
        raise ValueError(f"--fp16-init-scale must be an integer >= 1 (the dynamic loss scale's "
                         f"first value; fairseq's default 128), got {init!r}")
    window = _flag(cfg, "fp16_scale_window")
    if window is not None and int(window) < 1:
        raise ValueError("--fp16-scale-window must be an integer >= 1 (clean updates before the "
                         "dynamic loss scale grows; unset: 2**14 / (world size x update-freq)), "
                         f"got {window!r}")


def _validate_batch_shape_flags(cfg) -> None:
    """``--length-buckets`` and ``--cuda-graphs``, which needs it and ``--compile-layers``."""
    buckets = parse_length_buckets(_flag(cfg, "length_buckets", "off"))
    if buckets is not None and int(_flag(cfg, "num_batch_buckets", 0) or 0) > 0:
        raise ValueError("--length-buckets and fairseq's --num-batch-buckets both pad lengths to "
                         "buckets; pass one of them")
    if _flag(cfg, "cuda_graphs", False):
        if not _flag(cfg, "compile_layers", False):
            raise ValueError("--cuda-graphs runs the compiled layers as CUDA graphs; add "
                             "--compile-layers")
        if buckets is None:
            raise ValueError("--cuda-graphs needs --length-buckets N or auto: a graph is recorded "
                             "for each batch shape, and fairseq's own batches come in hundreds")


#: each diagnostics file flag and the interval flag that turns it on (None: the file alone does)
DIAGNOSTICS_FILES = {"scale_trace": None, "precision_stats": "precision_stats_interval",
                     "precision_divergence": "precision_divergence_interval"}


def _validate_diagnostics_flags(cfg) -> None:
    """The diagnostics' intervals and files; in an fp32 run, a warning for each flag that
    does nothing there."""
    for interval in ("precision_stats_interval", "precision_divergence_interval"):
        value = getattr(cfg, interval, 0)
        if value is not None and int(value) < 0:
            raise ValueError(f"--{interval.replace('_', '-')} must be >= 0 (0 = off), got {value!r}")
    for name, interval in DIAGNOSTICS_FILES.items():
        path = getattr(cfg, name, None)
        flag = "--" + name.replace("_", "-")
        if not path:
            continue
        if os.path.isdir(path) or path.endswith(("/", os.sep)):
            raise ValueError(f"{flag} must name a file (it is written as JSON lines), got the "
                             f"directory {path!r}")
        if interval and not int(getattr(cfg, interval, 0) or 0):
            # a warning, not a refusal: a checkpoint trained so still builds its task
            iflag = "--" + interval.replace("_", "-")
            logger.warning("%s %s: nothing is written without %s N (N >= 1: every N updates)",
                           flag, path, iflag)
    if not getattr(cfg, "fp16", False) and not getattr(cfg, "bf16", False):
        if getattr(cfg, "scale_trace", None):
            logger.warning("--scale-trace: an fp32 run has no loss scale and skips no update; "
                           "nothing is written (it traces --fp16/--bf16 runs)")
        if int(getattr(cfg, "precision_stats_interval", 0) or 0):
            logger.warning("--precision-stats-interval: an fp32 run has no half gradients and no "
                           "fp32 master weights; nothing is measured (it measures --fp16/--bf16 runs)")


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
    """Translation with the plugin's precision flags, CPU batch-length padding and
    reproducible resume."""

    cfg: TranslationFP16Config
    #: the multiple --cpu-length-multiple padded batch lengths to (1: not padded by it)
    _length_multiple = 1

    def __init__(self, cfg: TranslationFP16Config, src_dict, tgt_dict):
        validate_precision_flags(cfg)
        super().__init__(cfg, src_dict, tgt_dict)
        state = task_state(self)  # the precision features' decision, made once
        if state.precision.is_half and state.precision.on_cpu and not state.fp32_accumulate:
            self._bucket_cpu_shapes(state.precision.dtype)

    def _bucket_cpu_shapes(self, dtype: torch.dtype) -> None:
        """Native CPU half products: pad batch lengths (``--cpu-length-multiple``) and
        bound oneDNN's per-shape kernel caches (``--cpu-kernel-cache``)."""
        cfg = self.cfg
        multiple = resolve_length_multiple(cfg.cpu_length_multiple, dtype, native=True)
        given = int(getattr(cfg, "required_seq_len_multiple", 1) or 1)
        lengths = None
        if given > 1:
            lengths = f"padded to a multiple of {given} (--required-seq-len-multiple)"
            logger.info("CPU batch lengths: padded to a multiple of %d (--required-seq-len-multiple; "
                        "--cpu-length-multiple %s not applied)", given, cfg.cpu_length_multiple)
        elif multiple > 1:  # set on each dataset (load_dataset), not in the cfg checkpoints save
            self._length_multiple = multiple
            lengths = f"padded to a multiple of {multiple} (--cpu-length-multiple {cfg.cpu_length_multiple})"
            logger.info("CPU batch lengths: padded to a multiple of %d (--cpu-length-multiple %s; "
                        "the padding is masked)", multiple, cfg.cpu_length_multiple)
        capacity = resolve_kernel_cache(cfg.cpu_kernel_cache, max(given, multiple))
        caps = cap_cpu_kernel_caches(capacity)
        run_info.record(batch_lengths=lengths, kernel_caches=caps)
        logger.info(
            "CPU kernel caches: %s (--cpu-kernel-cache %s; a variable set in the "
            "environment wins)", ", ".join(f"{k}={v}" for k, v in caps.items()),
            cfg.cpu_kernel_cache,
        )

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

    def inference_step(self, generator, models, sample, *args, **kwargs):
        if self._length_multiple > 1:  # the beam's length limit counts source columns
            sample = drop_pad_columns(sample, self.source_dictionary.pad())
        return super().inference_step(generator, models, sample, *args, **kwargs)

    def get_batch_iterator(self, dataset, *args, **kwargs):
        """fairseq's iterator, with examples ordered as in epoch 1 (see the module docstring)."""
        if getattr(self.cfg, "rebuild_batches", False):  # batches re-made every epoch by design
            return super().get_batch_iterator(dataset, *args, **kwargs)
        seed = kwargs.get("seed", args[SEED_POSITION] if len(args) > SEED_POSITION else 1)
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
