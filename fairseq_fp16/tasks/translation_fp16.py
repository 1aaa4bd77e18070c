"""``--task translation_fp16``: fairseq's translation task with what the plugin adds for
translation data.

The precision features and their flags (loss scaling, ``--fp32-modules``, ``--half-matmul``,
``--fused-loss``, ``--attention-path``, ``--compile-layers``, ``--length-buckets``,
``--cuda-graphs``, the diagnostics) belong to every task (:mod:`fairseq_fp16.flags`,
:mod:`fairseq_fp16.features`), ``--task translation`` as well as this one. This task adds:

* ``--cpu-length-multiple`` and ``--cpu-kernel-cache``: CPU half runs on native kernels pad
  each batch's lengths so that batches come in few shapes (through the language-pair
  dataset's ``pad_to_multiple``; ``--max-tokens`` counts the padded lengths, and a resume
  inside an epoch cut with the other count is refused), and cap oneDNN's per-shape kernel
  caches, whose size follows from that padding (:mod:`fairseq_fp16.core.cpu_kernel_cache`).
  Both are decided once the model is built, before its first product (``auto`` weighs the
  model's products per batch): :meth:`TranslationFP16Task.fit_cpu_shapes`. Generation drops
  the padded source columns again, so decoding is as without padding;

A resumed run trains on the batches of the uninterrupted one under any task
(:mod:`fairseq_fp16.features`).
"""


import logging
from dataclasses import dataclass, field
from typing import Optional

import torch
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask
from omegaconf import II

from ..core.buckets import round_up
from ..core.cpu_kernel_cache import (
    AMX_UNPADDED_MIN_MACS,
    batch_products,
    cap_cpu_kernel_caches,
    resolve_kernel_cache,
    resolve_length_multiple,
)
from ..core.swap import swap_attribute
from ..features import task_state

logger = logging.getLogger(__name__)

#: the checkpoint's extra_state key of the multiple its training batches counted lengths in
BATCH_LENGTHS_KEY = "fairseq_fp16_batch_length_multiple"

__all__ = ["BATCH_LENGTHS_KEY", "TranslationFP16Config", "TranslationFP16Task", "check_resumed_batches",
           "count_padded_lengths", "drop_pad_columns"]


@dataclass
class TranslationFP16Config(TranslationConfig):
    """translation's config with CPU batch-length padding; the plugin's flags come to it as to
    every task (:func:`fairseq_fp16.flags.with_precision_flags`)."""

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
            "fp16: amx_fp16) and a batch's products take under 32 G multiply-adds "
            "(--max-tokens x the model's linear-layer weights), else 1 (lengths as they are). "
            "A --required-seq-len-multiple above 1 wins; fp32 runs are never padded by this flag"
        },
    )
    max_tokens: Optional[int] = II("dataset.max_tokens")  # weighs auto's padding


def validate_length_flags(cfg) -> None:
    """Refuse bad ``--cpu-length-multiple`` and ``--cpu-kernel-cache`` values before any data
    is read.

    Raises:
        ValueError: naming the flag and its valid values.
    """
    resolve_length_multiple(cfg.cpu_length_multiple, None, native=False)
    resolve_kernel_cache(cfg.cpu_kernel_cache, 1)


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
    """Translation with CPU batch-length padding."""

    cfg: TranslationFP16Config
    #: the multiple --cpu-length-multiple padded batch lengths to, which --max-tokens counts
    #: (1: not padded by it); checkpoints keep it (:func:`check_resumed_batches`)
    length_multiple = 1

    def __init__(self, cfg: TranslationFP16Config, src_dict, tgt_dict):
        validate_length_flags(cfg)
        super().__init__(cfg, src_dict, tgt_dict)  # the plugin's flags are checked there
        state = task_state(self)  # the precision features' decision, made once
        native = state.precision.is_half and state.precision.on_cpu and not state.fp32_accumulate
        #: the half dtype whose batch shapes are still to be fitted (None: fitted, or no need)
        self._unfitted: Optional[torch.dtype] = state.precision.dtype if native else None

    def fit_cpu_shapes(self, model: Optional[torch.nn.Module] = None) -> None:
        """Native CPU half products: pad batch lengths (``--cpu-length-multiple``) and bound
        oneDNN's per-shape kernel caches (``--cpu-kernel-cache``). Decided once: for the first
        model built (:func:`fairseq_fp16.features.prepare_model` calls this before anything
        runs a product, as the caches' capacities must be set by then), or without a model where
        a dataset is loaded first."""
        dtype, self._unfitted = self._unfitted, None
        if dtype is None:
            return
        cfg = self.cfg
        try:
            max_tokens = cfg.max_tokens
        except Exception:  # a config outside a run's (no dataset.max_tokens to interpolate)
            max_tokens = None
        products = batch_products(model, max_tokens if isinstance(max_tokens, int) else None)
        multiple = resolve_length_multiple(cfg.cpu_length_multiple, dtype, native=True,
                                           products=products)
        if products is not None and str(cfg.cpu_length_multiple) == "auto":
            logger.info("CPU batch products: %.1f G multiply-adds (--max-tokens %d x %.1f M "
                        "linear-layer weights); --cpu-length-multiple auto pads on AMX below %d G",
                        products / 1e9, max_tokens, products / max_tokens / 1e6,
                        AMX_UNPADDED_MIN_MACS // 10**9)
        given = int(getattr(cfg, "required_seq_len_multiple", 1) or 1)
        lengths = None
        if given > 1:
            lengths = f"padded to a multiple of {given} (--required-seq-len-multiple)"
            logger.info("CPU batch lengths: padded to a multiple of %d (--required-seq-len-multiple; "
                        "--cpu-length-multiple %s not applied)", given, cfg.cpu_length_multiple)
        elif multiple > 1:  # set on each dataset (load_dataset), not in the cfg checkpoints save
            self.length_multiple = multiple
            lengths = f"padded to a multiple of {multiple} (--cpu-length-multiple {cfg.cpu_length_multiple})"
            logger.info("CPU batch lengths: padded to a multiple of %d (--cpu-length-multiple %s; "
                        "the padding is masked)", multiple, cfg.cpu_length_multiple)
        capacity = resolve_kernel_cache(cfg.cpu_kernel_cache, max(given, multiple))
        caps = cap_cpu_kernel_caches(capacity)
        task_state(self).context.record.record(batch_lengths=lengths, kernel_caches=caps)
        logger.info(
            "CPU kernel caches: %s (--cpu-kernel-cache %s; a variable set in the "
            "environment wins)", ", ".join(f"{k}={v}" for k, v in caps.items()),
            cfg.cpu_kernel_cache,
        )

    def load_dataset(self, split, epoch=1, combine=False, **kwargs):
        self.fit_cpu_shapes()  # fairseq's commands build the model first
        super().load_dataset(split, epoch=epoch, combine=combine, **kwargs)
        if self.length_multiple > 1:
            dataset = self.datasets[split]
            if not hasattr(dataset, "pad_to_multiple"):
                raise RuntimeError(
                    f"--cpu-length-multiple: fairseq's {type(dataset).__name__} has no "
                    "pad_to_multiple (changed fairseq?); pass --cpu-length-multiple 1"
                )
            dataset.pad_to_multiple = self.length_multiple  # what its collater pads to
            count_padded_lengths(dataset, self.length_multiple)

    def inference_step(self, generator, models, sample, *args, **kwargs):
        if self.length_multiple > 1:  # the beam's length limit counts source columns
            sample = drop_pad_columns(sample, self.source_dictionary.pad())
        return super().inference_step(generator, models, sample, *args, **kwargs)


def count_padded_lengths(dataset, multiple: int) -> None:
    """Make ``dataset`` count each sentence as its length padded to ``multiple`` where fairseq
    enforces ``--max-tokens``, so that a batch of padded lengths stays within it (fairseq
    counts the lengths as they are: batches of short sentences padded to 8 held up to 60% more
    positions than ``--max-tokens``); fairseq's bucket-padded datasets count their padding
    the same way."""
    counted, counted_vec = dataset.num_tokens, dataset.num_tokens_vec
    swap_attribute(dataset, "num_tokens", lambda index: round_up(counted(index), multiple),
                   expects=["enforce ``--max-tokens``"])
    swap_attribute(dataset, "num_tokens_vec", lambda indices: round_up(counted_vec(indices), multiple),
                   expects=["enforce ``--max-tokens``"])


def check_resumed_batches(task, extra_state: dict, filename: str, reset_dataloader: bool) -> None:
    """Refuse to resume ``filename`` inside an epoch whose batches it cut with other counted
    lengths than ``task`` cuts them (:func:`count_padded_lengths`): fairseq would skip the
    batches done by position in another list of batches, and train on other sentences than
    the uninterrupted run. A checkpoint without the key counted lengths as they are.

    Raises:
        ValueError: naming the flags that resume it.
    """
    saved = int(extra_state.get(BATCH_LENGTHS_KEY, 1))
    current = int(getattr(task, "length_multiple", 1))
    done = (extra_state.get("train_iterator") or {}).get("iterations_in_epoch", 0)
    if saved != current and done and not reset_dataloader:
        def counted(n):
            return "the lengths as they are" if n == 1 else f"lengths padded to a multiple of {n}"

        raise ValueError(
            f"fairseq_fp16: {filename} stopped {done} batches into an epoch whose batches counted "
            f"{counted(saved)} toward --max-tokens; this run counts {counted(current)} and would "
            f"train on other sentences than the run it continues. Pass --cpu-length-multiple {saved} "
            "(half-precision runs) to resume it exactly, or --reset-dataloader to start the epoch afresh")
