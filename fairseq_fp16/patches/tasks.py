"""Patches of fairseq's task base classes: the precision features for every task.

fairseq's tasks build the model, the criterion and the generator, and run the train, valid and
inference steps, in methods of ``FairseqTask`` (and ``LegacyFairseqTask``) that most tasks
inherit or call through ``super()``. Wrapped here, those methods give any task run with the
plugin loaded:

* ``build_model``: parameter names recorded (diagnostics, ``--no-decay-params``), fp32 islands
  (norms, ``--fp32-modules``), the attention path (``--attention-path``; cuDNN's attention off
  for half precision on CUDA), ``--compile-layers``;
* ``build_criterion``: the fused fp32 loss for half runs (``--fused-loss``);
* ``train_step`` / ``valid_step`` / ``inference_step``: the CPU matrix-product mode
  (``--half-matmul``), the first steps' count of half products left on native kernels, and
  ``--precision-divergence-interval``;
* ``get_batch_iterator``: a resumed run trains on the batches of the uninterrupted one (a reused
  iterator's examples ordered with the epoch-1 seed), and ``--length-buckets`` (the training
  set's batches in a few shapes);
* ``build_generator``: ``--bf16`` generation casts the models to bf16 (stock fairseq-generate
  casts only for ``--fp16``), and the n-gram blocker that blocks nothing off CUDA is replaced.

Flags are read from the task's config (``cfg``, or a legacy task's ``args``), where every task has
them (:mod:`fairseq_fp16.flags`); a config without them (a stock checkpoint's) gives the
defaults. The precision is the run's (:func:`fairseq_fp16.precision.current`) or,
before a command's ``main`` started, the task config's ``fp16``/``bf16``.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from contextlib import contextmanager
from functools import wraps
from typing import Optional

import torch
from fairseq.data import data_utils
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase

from ..core.buckets import BucketedBatching, parse_length_buckets
from ..core.compile import compile_training_forward
from ..core.divergence import forward_divergence, summarize_divergence
from ..core.fp32_islands import apply_fp32_islands
from ..core.fused_loss import PATHS as FUSED_LOSS_PATHS
from ..core.half_matmul import NativeHalfProducts, half_matmul_context, resolve_half_matmul
from ..core.master_weights import tag_param_names
from ..core.ngram_block import NGramBlock
from .. import run_info
from ..flags import ATTENTION_PATHS, flag, resolve_attention_path, task_config
from ..precision import Precision, current
from .registry import Patch
from .registry import original as _original

logger = logging.getLogger(__name__)

__all__ = ["ATTENTION_PATHS", "PATCHES", "avoid_cudnn_attention", "resolve_attention_path",
           "task_precision", "task_state"]

BASE = "fairseq.tasks.fairseq_task:FairseqTask"
LEGACY = "fairseq.tasks.fairseq_task:LegacyFairseqTask"


def _flag(task, name, default):
    return flag(task_config(task), name, default)


def task_precision(task) -> Precision:
    """The run's precision, or the task config's ``fp16``/``bf16`` before a command's main."""
    run = current()
    if run is not None:
        return run
    cfg = task_config(task)
    return Precision.from_flags(bool(flag(cfg, "fp16", False)), bool(flag(cfg, "bf16", False)),
                                cpu=bool(flag(cfg, "cpu", False)))


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


class _TaskState:
    """What the wrappers keep per task instance."""

    def __init__(self, task) -> None:
        precision = task_precision(task)
        self.precision = precision
        self.fp32_accumulate = bool(
            precision.is_half and precision.on_cpu
            and resolve_half_matmul(str(_flag(task, "half_matmul", "auto")), precision.dtype))
        self.checked_steps = set()  # steps whose native half products were counted
        self.divergence_done = None  # the update whose forward divergence was measured
        half_matmul = None
        if precision.is_half and precision.on_cpu:
            half_matmul = "{} (--half-matmul {})".format(
                "fp32 accumulation, rounded to half" if self.fp32_accumulate else "native kernels",
                _flag(task, "half_matmul", "auto"))
            logger.info("CPU %s matrix products: %s", precision.name, half_matmul)
        run_info.record(precision=precision.name, device="cpu" if precision.on_cpu else "cuda",
                        half_matmul=half_matmul, native_half_products=None)


def task_state(task) -> _TaskState:
    """The precision features' state of ``task``, made on first use."""
    state = task.__dict__.get("_fairseq_fp16_state")
    if state is None:
        state = task.__dict__["_fairseq_fp16_state"] = _TaskState(task)
    return state


# ------------------------------------------------------------------------------ build_model
def prepare_model(task, model):
    """Names, fp32 islands, attention path and compiled layers for ``model`` (idempotent)."""
    state = task_state(task)
    precision = state.precision
    tag_param_names(model.named_parameters())
    regex = _flag(task, "fp32_modules", None)
    matched = apply_fp32_islands(model, regex)
    if regex:
        if matched:
            logger.info("fp32 modules (--fp32-modules): %s", ", ".join(matched))
        else:
            logger.warning("--fp32-modules %r matched no module name; names look like %s", regex,
                           ", ".join(n for n, _ in list(model.named_modules())[1:4]))
    choice = str(_flag(task, "attention_path", "auto"))
    path = resolve_attention_path(choice, precision.is_half, precision.on_cpu)
    attentions = [m for m in model.modules() if isinstance(m, MultiheadAttention)]
    if path == "fairseq":
        for module in attentions:
            module._set_skip_embed_dim_check()  # fairseq's own path, with its fp32 softmax
    if path == "torch" and precision.is_half and not precision.on_cpu and attentions:
        avoid_cudnn_attention()
    if attentions:
        logger.info("attention: %s (--attention-path %s)", "fairseq's own, softmax in fp32"
                    if path == "fairseq" else "torch's fused multi_head_attention_forward", choice)
    run_info.record(attention=path if attentions else None,
                    compile_layers=bool(_flag(task, "compile_layers", False)))
    if _flag(task, "compile_layers", False):
        layers = [m for m in model.modules()
                  if isinstance(m, (TransformerEncoderLayerBase, TransformerDecoderLayerBase))]
        if not layers:
            raise ValueError(f"--compile-layers: {type(model).__name__} has no transformer "
                             "encoder or decoder layers to compile")
        graphs = bool(_flag(task, "cuda_graphs", False))
        compile_training_forward(layers, mode="reduce-overhead" if graphs else None)
        logger.info("--compile-layers: the training forward of %d transformer layers is "
                    "compiled (torch.compile, dynamic shapes%s)", len(layers), "" if not graphs
                    else "; --cuda-graphs: no CUDA graphs on the CPU" if precision.on_cpu
                    else "; run as CUDA graphs, one recorded per batch shape (--cuda-graphs)")
    return model


def _build_model_of(target):
    def build_model(self, cfg, from_checkpoint=False):
        return prepare_model(self, _original(target)(self, cfg, from_checkpoint))

    return build_model


# -------------------------------------------------------------------------- build_criterion
def _build_criterion_of(target):
    def build_criterion(self, cfg, *args, **kwargs):
        from ..fused_criterion import fused_criterion_class

        criterion = _original(target)(self, cfg, *args, **kwargs)
        mode = str(_flag(self, "fused_loss", "auto"))
        run_info.record(fused_loss=False)
        if mode == "off" or (mode == "auto" and not task_state(self).precision.is_half):
            return criterion
        fused = fused_criterion_class(criterion)
        if fused is None:
            (logger.warning if mode != "auto" else logger.info)(
                "--fused-loss %s: the criterion %s has no fused loss (only cross_entropy and "
                "label_smoothed_cross_entropy); its own is used", mode, type(criterion).__name__)
            return criterion
        run_info.record(fused_loss=True)
        fused_criterion = fused.build_criterion(cfg, self)
        if mode in FUSED_LOSS_PATHS:
            fused_criterion.fused_loss_path = mode
        elif _flag(self, "compile_layers", False):  # compiled layers: the compiled loss too
            fused_criterion.fused_loss_path = "compiled"
        path = fused_criterion.fused_loss_path
        logger.info("--fused-loss %s: %s computes its loss from the logits in fp32 chunks%s, "
                    "keeping no fp32 log-probabilities", mode,
                    getattr(cfg, "_name", None) or type(criterion).__name__,
                    f" (the {path} path)" if path else "")
        return fused_criterion

    return build_criterion


# ----------------------------------------------------------------------------------- steps
@contextmanager
def _native_products_check(state: _TaskState, step: str):
    """The first training (generation) step under fp32 accumulation counts the half products
    that escaped it, and logs what it found."""
    if not state.fp32_accumulate or step in state.checked_steps:
        yield
        return
    state.checked_steps.add(step)
    with NativeHalfProducts() as check:
        yield
    if step == "training step":
        run_info.record(native_half_products=sum(check.counts.values()))
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


def _divergence_due(task, state, sample, optimizer, update_num, ignore_grad) -> bool:
    interval = int(_flag(task, "precision_divergence_interval", 0))
    if (not interval or update_num % interval or update_num == state.divergence_done
            or ignore_grad or not sample or "net_input" not in sample
            or (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0)):
        return False
    if getattr(optimizer, "core", None) is None:  # no plugin masters to compare against
        if state.divergence_done is None:
            logger.warning("--precision-divergence-interval: this run has no fp32 master "
                           "weights of the plugin's (an fp32 run, or an optimizer other than "
                           "fp16_adam); nothing is measured")
            state.divergence_done = -1
        return False
    return True


def _measure_divergence(task, state, sample, model, optimizer, update_num) -> None:
    """The forward divergence of this update's batch (first micro-batch), logged and appended
    to the JSONL file."""
    state.divergence_done = update_num
    errors = forward_divergence(model, optimizer.core.masters_by_param(), sample["net_input"])
    path = _flag(task, "precision_divergence", None) or os.path.join(
        _flag(task, "save_dir", "."), "precision_divergence.jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    record = {"update": update_num, "dtype": str(state.precision.dtype).replace("torch.", ""),
              "modules": errors}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    logger.info("forward divergence @ update %d (relative to fp32): %s", update_num,
                summarize_divergence(errors))


def _train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
    state = task_state(self)
    with half_matmul_context(state.fp32_accumulate):
        if _divergence_due(self, state, sample, optimizer, update_num, ignore_grad):
            _measure_divergence(self, state, sample, model, optimizer, update_num)
        with _native_products_check(state, "training step"):
            return _original(f"{BASE}.train_step")(self, sample, model, criterion, optimizer,
                                                   update_num, ignore_grad)


def _valid_step(self, *args, **kwargs):
    with half_matmul_context(task_state(self).fp32_accumulate):
        return _original(f"{BASE}.valid_step")(self, *args, **kwargs)


def _inference_step(self, *args, **kwargs):
    state = task_state(self)
    with half_matmul_context(state.fp32_accumulate), _native_products_check(state, "generation step"):
        return _original(f"{BASE}.inference_step")(self, *args, **kwargs)


def _build_generator(self, models, args, *rest, **kwargs):
    if task_state(self).precision.name == "bf16":
        for model in models:
            model.to(torch.bfloat16)  # fp32 islands stay fp32
    generator = _original(f"{BASE}.build_generator")(self, models, args, *rest, **kwargs)
    blocker = getattr(generator, "repeat_ngram_blocker", None)
    if blocker is not None and not getattr(blocker, "use_extension", True):
        # fairseq's fallback off its CUDA kernel blocks nothing (fairseq issue #5206)
        generator.repeat_ngram_blocker = NGramBlock(blocker.no_repeat_ngram_size)
        logger.info("--no-repeat-ngram-size %d: repeats blocked by the plugin's NGramBlock "
                    "(fairseq's fallback off its CUDA kernel blocks none)",
                    blocker.no_repeat_ngram_size)
    return generator


#: positions of ``seed`` and ``disable_iterator_cache`` among FairseqTask.get_batch_iterator's
#: arguments after ``dataset``
SEED_POSITION, DISABLE_CACHE_POSITION = 5, 11


def _argument(args, kwargs, name: str, position: int, default):
    """get_batch_iterator's argument ``name``, passed by keyword or at ``position`` after the
    dataset."""
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else default


def _reused_for_every_epoch(task, dataset, args, kwargs) -> bool:
    """Whether fairseq makes the batches of ``dataset`` once and reuses them in later epochs
    (the iterator cached, the batches not rebuilt each epoch)."""
    if _argument(args, kwargs, "disable_iterator_cache", DISABLE_CACHE_POSITION, False):
        return False
    if kwargs.get("update_epoch_batch_itr", False) or getattr(task.cfg, "rebuild_batches", False):
        return False
    return bool(task.can_reuse_epoch_itr(dataset))


def _get_batch_iterator(self, dataset, *args, **kwargs):
    """fairseq's batch iterator, with the examples of a reused one ordered as in epoch 1; with
    ``--length-buckets`` the training set batches and collates in bucket shapes
    (:class:`~fairseq_fp16.core.buckets.BucketedBatching`).

    fairseq(-fixed) 0.12.3 orders the examples under ``numpy_seed(seed + epoch)`` with the epoch
    in which the iterator is made, and reuses its batches in later epochs: a run resumed in epoch 2
    or later would train on differently composed batches than the uninterrupted run. Ordered with
    the epoch-1 seed, every run sees the batches a fresh run makes."""
    choice = parse_length_buckets(_flag(self, "length_buckets", "off"))
    datasets = getattr(self, "datasets", None) or {}
    if choice is not None and dataset is datasets.get(_flag(self, "train_subset", "train")):
        BucketedBatching.install(dataset, choice)
    make = _original(f"{BASE}.get_batch_iterator")
    if not _reused_for_every_epoch(self, dataset, args, kwargs):
        return make(self, dataset, *args, **kwargs)
    seed = _argument(args, kwargs, "seed", SEED_POSITION, 1)
    ordered_indices = dataset.ordered_indices
    own = vars(dataset).get("ordered_indices")

    @wraps(ordered_indices)
    def first_epoch_order():
        with data_utils.numpy_seed(seed + 1):
            return ordered_indices()

    dataset.ordered_indices = first_epoch_order
    try:
        return make(self, dataset, *args, **kwargs)
    finally:
        if own is None:
            del dataset.ordered_indices
        else:
            dataset.ordered_indices = own


def _argument_positions(fn) -> Optional[str]:
    names = list(inspect.signature(fn).parameters)[2:]  # after self, dataset
    for name, position in (("seed", SEED_POSITION), ("disable_iterator_cache", DISABLE_CACHE_POSITION)):
        if len(names) <= position or names[position] != name:
            return f"{name} is not argument {position} after dataset: {names[:position + 1]}"
    return None


PATCHES = [
    Patch(f"{BASE}.build_model", group="precision", replacement=_build_model_of(f"{BASE}.build_model"),
          expects=["model = models.build_model(cfg, self, from_checkpoint)"],
          why="the model every task builds gets parameter names, fp32 islands (kept fp32 by the "
              "trainer's later half cast), the attention path and --compile-layers"),
    Patch(f"{LEGACY}.build_model", group="precision", replacement=_build_model_of(f"{LEGACY}.build_model"),
          expects=["model = models.build_model(args, self, from_checkpoint)"],
          why="the same for tasks on the legacy (argparse) base class, e.g. language_modeling"),
    Patch(f"{BASE}.build_criterion", group="precision",
          replacement=_build_criterion_of(f"{BASE}.build_criterion"),
          expects=["return criterions.build_criterion(cfg, self, from_checkpoint=from_checkpoint)"],
          why="half runs take the fused fp32 loss for cross_entropy and "
              "label_smoothed_cross_entropy (--fused-loss)"),
    Patch(f"{LEGACY}.build_criterion", group="precision",
          replacement=_build_criterion_of(f"{LEGACY}.build_criterion"),
          expects=["return criterions.build_criterion(args, self)"],
          why="the same for tasks on the legacy base class"),
    Patch(f"{BASE}.train_step", group="precision", replacement=_train_step,
          expects=["optimizer.backward(loss)"],
          why="the train step runs in the CPU matrix-product mode (--half-matmul), counts the "
              "first step's native half products, and measures --precision-divergence-interval"),
    Patch(f"{BASE}.valid_step", group="precision", replacement=_valid_step,
          expects=["loss, sample_size, logging_output = criterion(model, sample)"],
          why="the valid step runs in the CPU matrix-product mode"),
    Patch(f"{BASE}.inference_step", group="precision", replacement=_inference_step,
          expects=["return generator.generate("],
          why="generation runs in the CPU matrix-product mode and counts its native half products"),
    Patch(f"{BASE}.build_generator", group="repair", replacement=_build_generator,
          expects=["no_repeat_ngram_size"],
          why="fairseq-generate --bf16 casts the models to bf16 (stock casts only for --fp16), "
              "and --no-repeat-ngram-size off CUDA gets a blocker that blocks (fairseq's "
              "fallback compares with the buffer's padding and blocks nothing)"),
    Patch("fairseq.ngram_repeat_block:NGramRepeatBlock.__init__", group="repair",
          expects=["self.use_extension = is_cuda_extension_usable() if use_extension else False"],
          why="relied on: use_extension says whether fairseq's blocker runs its CUDA kernel"),
    Patch(f"{BASE}.get_batch_iterator", group="precision", replacement=_get_batch_iterator,
          expects=["with data_utils.numpy_seed(seed + epoch):", "indices = dataset.ordered_indices()",
                   "batches = dataset.batch_by_size(", "collate_fn=dataset.collater,",
                   "and self.can_reuse_epoch_itr(dataset)", "return self.dataset_to_epoch_iter[dataset]"],
          condition=lambda fn: _argument_positions(fn),
          why="a reused iterator's examples are ordered with the epoch-1 seed (fairseq seeds them "
              "with the epoch the iterator is made in, so a run resumed in epoch 2 or later trained "
              "on other batches than the uninterrupted run), through dataset.ordered_indices "
              "wrapped around this call; with --length-buckets the training set's batch_by_size and "
              "collater, which this calls, are replaced on the dataset by bucketed ones (batches of "
              "a few fixed shapes for CUDA graphs)"),
    Patch("fairseq.data.language_pair_dataset:LanguagePairDataset.collater", group="precision",
          expects=["pad_to_multiple=self.pad_to_multiple", "pad_to_length=pad_to_length,"],
          why="relied on: --cpu-length-multiple sets the dataset's pad_to_multiple, which its "
              "collater pads batch lengths to; --length-buckets pads to a bucket's lengths through "
              "its pad_to_length"),
    Patch("fairseq.modules.multihead_attention:MultiheadAttention.forward", group="precision",
          expects=["and not self.skip_embed_dim_check", "F.multi_head_attention_forward("],
          why="relied on: _set_skip_embed_dim_check() sends a layer down fairseq's own attention "
              "(fp32 softmax), the CPU half runs' path; otherwise torch's fused one"),
]
