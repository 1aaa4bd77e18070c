"""The precision features every task gets with the plugin loaded, as functions of the task.

fairseq's task base classes build the model, the criterion and the generator, make the batch
iterator and run the train, valid and inference steps; :mod:`fairseq_fp16.patches.tasks` wraps
those methods and calls these functions:

* :func:`prepare_model`: the task's batch shapes first (``fit_cpu_shapes``, translation_fp16),
  parameter names recorded (diagnostics, ``--no-decay-params``), fp32
  islands (norms, ``--fp32-modules``), the attention path (``--attention-path``; cuDNN's
  attention off for half precision on CUDA), the CPU's dropout masks (``--cpu-dropout``),
  ``--compile-layers``;
* :func:`fused_criterion`: the fused fp32 loss for half runs (``--fused-loss``);
* :class:`TaskState` (:func:`task_state`): the CPU matrix-product mode (``--half-matmul``) the
  steps run in; :func:`cpu_autocast`, ``--amp`` on the CPU as torch's bf16 autocast;
  :func:`native_products_check`, the first steps' count of half products left on native kernels;
  :func:`divergence_due` / :func:`measure_divergence`,
  ``--precision-divergence-interval``;
* :func:`inference_model`: ``--bf16`` inference casts the model to bf16 (stock fairseq casts
  only for ``--fp16``); :func:`repair_ngram_blocker`, a blocker that
  blocks off CUDA;
* :func:`bucket_training_batches` (``--length-buckets``) and :func:`first_epoch_order` (a
  resumed run trains on the batches of the uninterrupted one).

The precision and the flags are the task's run context (:func:`fairseq_fp16.context.run_context`:
made from the task's config, where every task has the flags; a config without them, a stock
checkpoint's, gives the defaults).
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager, nullcontext
from functools import wraps
from typing import Optional

import torch
from fairseq.data import data_utils
from fairseq.modules.fairseq_dropout import FairseqDropout
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase

from .batching import BucketedBatching
from .core.buckets import parse_length_buckets
from .core.compile import compile_training_forward
from .core.cpu_linear import bias_in_product
from .core.divergence import forward_divergence, summarize_divergence
from .core.dropout import AUTO_MIN_NUMEL, counter_dropout_available
from .core.fp32_islands import apply_fp32_islands
from .core.fused_loss import CPU_COMPILED_MIN_NUMEL as FUSED_LOSS_MIN_COMPILED
from .core.fused_loss import PATHS as FUSED_LOSS_PATHS
from .core.half_matmul import NativeHalfProducts, resolve_half_matmul
from .core.master_weights import tag_param_names
from .core.swap import swap_attribute
from .core.ngram_block import NGramBlock
from .context import RunContext, run_context
from .flags import resolve_attention_path

logger = logging.getLogger(__name__)

__all__ = ["COUNTER_MASKS", "TaskState", "avoid_cudnn_attention", "bucket_training_batches",
           "cpu_autocast", "cpu_dropout_masks", "divergence_due",
           "first_epoch_order", "fused_criterion", "inference_model", "measure_divergence",
           "native_products_check", "prepare_model", "repair_ngram_blocker", "task_state"]


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


class TaskState:
    """What the features keep per task instance: its run context, and what the steps decided."""

    def __init__(self, context: RunContext) -> None:
        self.context = context
        precision = self.precision = context.precision
        choice = str(context.flags.half_matmul)
        self.fp32_accumulate = bool(
            precision.is_half and precision.on_cpu and resolve_half_matmul(choice, precision.dtype))
        self.checked_steps = set()  # steps whose native half products were counted
        self.divergence_done = None  # the update whose forward divergence was measured
        self.amp_logged = False  # cpu_autocast said what --amp does on the CPU
        half_matmul = None
        if precision.is_half and precision.on_cpu:
            half_matmul = "{} (--half-matmul {})".format(
                "fp32 accumulation, rounded to half" if self.fp32_accumulate else "native kernels",
                choice)
            logger.info("CPU %s matrix products: %s", precision.name, half_matmul)
        context.record.record(precision=precision.name, device="cpu" if precision.on_cpu else "cuda",
                              half_matmul=half_matmul, native_half_products=None)


def task_state(task) -> TaskState:
    """The precision features' state of ``task``, made on first use."""
    state = task.__dict__.get("_fairseq_fp16_state")
    if state is None:
        state = task.__dict__["_fairseq_fp16_state"] = TaskState(run_context(task))
    return state


# ------------------------------------------------------------------------------ the model
def prepare_model(task, model):
    """Names, fp32 islands, attention path and compiled layers for ``model`` (idempotent)."""
    state = task_state(task)
    precision, flags = state.precision, state.context.flags
    fit_shapes = getattr(task, "fit_cpu_shapes", None)  # translation_fp16: before any product
    if fit_shapes is not None:
        fit_shapes(model)
    tag_param_names(model.named_parameters())
    regex = flags.fp32_modules
    matched = apply_fp32_islands(model, regex)
    if regex:
        if matched:
            logger.info("fp32 modules (--fp32-modules): %s", ", ".join(matched))
        else:
            logger.warning("--fp32-modules %r matched no module name; names look like %s", regex,
                           ", ".join(n for n, _ in list(model.named_modules())[1:4]))
    choice = str(flags.attention_path)
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
    if precision.is_half and precision.on_cpu and not state.fp32_accumulate:
        fused = bias_in_product(model, precision.dtype)
        if fused:
            logger.info("CPU linear layers: the bias added inside oneDNN's %s product in %d layers "
                        "(F.linear's bits, one pass less)", precision.name, fused)
    state.context.record.record(attention=path if attentions else None,
                                compile_layers=bool(flags.compile_layers),
                                cpu_dropout=cpu_dropout_masks(task, model))
    if flags.compile_layers:
        layers = [m for m in model.modules()
                  if isinstance(m, (TransformerEncoderLayerBase, TransformerDecoderLayerBase))]
        if not layers:
            raise ValueError(f"--compile-layers: {type(model).__name__} has no transformer "
                             "encoder or decoder layers to compile")
        graphs = bool(flags.cuda_graphs)
        compile_training_forward(layers, mode="reduce-overhead" if graphs else None)
        logger.info("--compile-layers: the training forward of %d transformer layers is "
                    "compiled (torch.compile, dynamic shapes%s)", len(layers), "" if not graphs
                    else "; --cuda-graphs: no CUDA graphs on the CPU" if precision.on_cpu
                    else "; run as CUDA graphs, one recorded per batch shape (--cuda-graphs)")
    return model


#: the attribute of a FairseqDropout module that turns its counter-based masks on: the fewest
#: elements a tensor takes them (:mod:`fairseq_fp16.patches.dropout`); absent or None: torch's
COUNTER_MASKS = "counter_min_numel"


def cpu_dropout_masks(task, model) -> Optional[str]:
    """``--cpu-dropout``: counter-based masks for the ``FairseqDropout`` modules of a model
    trained on the CPU (:mod:`fairseq_fp16.patches.dropout`): ``counter`` on every tensor,
    ``auto`` on tensors of at least :data:`~fairseq_fp16.core.dropout.AUTO_MIN_NUMEL` elements
    where the kernel compiles (tried at the first such tensor). Returns the choice, None without
    dropout modules or off the CPU.

    Raises:
        ValueError: ``--cpu-dropout counter`` where torch.compile cannot build the kernel.
    """
    dropouts = [m for m in model.modules() if isinstance(m, FairseqDropout)]
    state = task_state(task)
    precision = state.precision
    if not dropouts or not precision.on_cpu:
        return None
    choice = str(state.context.flags.cpu_dropout)
    if choice == "counter" and not counter_dropout_available(precision.dtype):
        raise ValueError("--cpu-dropout counter: torch.compile cannot build the counter-based "
                         "mask on this machine (the warning above says why); use --cpu-dropout "
                         "torch")
    min_numel = {"auto": AUTO_MIN_NUMEL, "counter": 0}.get(choice)
    for module in dropouts:
        setattr(module, COUNTER_MASKS, min_numel)
    logger.info("dropout on the CPU (--cpu-dropout %s): %s", choice, {
        "auto": f"counter-based masks for tensors of {AUTO_MIN_NUMEL:,} elements or more, "
                "torch's for smaller ones",
        "counter": "counter-based masks", "torch": "torch's masks"}[choice])
    return choice


# ------------------------------------------------------------------------------ the criterion
def fused_criterion(task, criterion, cfg):
    """``criterion`` (built from ``cfg``), or its fused fp32 loss (``--fused-loss``) where the
    run and the criterion take one."""
    from .fused_criterion import fused_criterion_class

    state = task_state(task)
    mode = str(state.context.flags.fused_loss)
    state.context.record.record(fused_loss=False)
    if mode == "off" or (mode == "auto" and not state.precision.is_half):
        return criterion
    fused = fused_criterion_class(criterion)
    if fused is None:
        (logger.warning if mode != "auto" else logger.info)(
            "--fused-loss %s: the criterion %s has no fused loss (only cross_entropy and "
            "label_smoothed_cross_entropy); its own is used", mode, type(criterion).__name__)
        return criterion
    state.context.record.record(fused_loss=True)
    fused_loss = fused.build_criterion(cfg, task)
    if mode in FUSED_LOSS_PATHS:
        fused_loss.fused_loss_path = mode
    elif state.context.flags.compile_layers:  # compiled layers: the compiled loss too
        fused_loss.fused_loss_path = "compiled"
    path = fused_loss.fused_loss_path
    if path is None and state.precision.on_cpu:
        path = (f"compiled for logits of {FUSED_LOSS_MIN_COMPILED:,} elements or more where "
                "torch.compile builds it, else cache")
    logger.info("--fused-loss %s: %s computes its loss from the logits in fp32 chunks%s, "
                "keeping no fp32 log-probabilities", mode,
                getattr(cfg, "_name", None) or type(criterion).__name__,
                f" (the {path} path)" if path else "")
    return fused_loss


# ---------------------------------------------------------------------------------- the steps
def cpu_autocast(state: TaskState, optimizer):
    """``--amp`` on the CPU: the training step under ``torch.autocast("cpu", torch.bfloat16)``
    (fp32 weights; the products in bf16, the operators autocast lists in fp32; the backward
    pass's operators in the dtypes of the forward's). fairseq's step enters CUDA's autocast
    only, which is off without CUDA, so ``--amp --cpu`` trained in fp32; its GradScaler stays
    off on the CPU, which bf16 does not need. A null context otherwise."""
    from fairseq.optim.amp_optimizer import AMPOptimizer

    if not (isinstance(optimizer, AMPOptimizer) and state.precision.on_cpu):
        return nullcontext()
    if not state.amp_logged:
        state.amp_logged = True
        logger.info("--amp on the CPU: the training step under torch.autocast('cpu', "
                    "torch.bfloat16); fp32 weights, no loss scaling")
    return torch.autocast("cpu", dtype=torch.bfloat16)


@contextmanager
def native_products_check(state: TaskState, step: str):
    """The first training (generation) step under fp32 accumulation counts the half products
    that escaped it, and logs what it found."""
    if not state.fp32_accumulate or step in state.checked_steps:
        yield
        return
    state.checked_steps.add(step)
    with NativeHalfProducts() as check:
        yield
    if step == "training step":
        state.context.record.record(native_half_products=sum(check.counts.values()))
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


def divergence_due(state: TaskState, sample, optimizer, update_num, ignore_grad) -> bool:
    interval = int(state.context.flags.precision_divergence_interval or 0)
    if (not interval or update_num % interval or update_num == state.divergence_done
            or ignore_grad or not sample or "net_input" not in sample
            or (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0)):
        return False
    masters = getattr(optimizer, "masters_by_param", None)
    if masters is None or not masters():  # no plugin masters to compare against
        if state.divergence_done is None:
            logger.warning("--precision-divergence-interval: this run has no fp32 master "
                           "weights of the plugin's (an fp32 run, or an optimizer other than "
                           "fp16_adam); nothing is measured")
            state.divergence_done = -1
        return False
    return True


def measure_divergence(state: TaskState, sample, model, optimizer, update_num) -> None:
    """The forward divergence of this update's batch (first micro-batch), logged and appended
    to the JSONL file."""
    state.divergence_done = update_num
    errors = forward_divergence(model, optimizer.masters_by_param(), sample["net_input"])
    context = state.context
    path = context.flags.precision_divergence or os.path.join(
        context.save_dir, "precision_divergence.jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    record = {"update": update_num, "dtype": str(state.precision.dtype).replace("torch.", ""),
              "modules": errors}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    logger.info("forward divergence @ update %d (relative to fp32): %s", update_num,
                summarize_divergence(errors))


# ----------------------------------------------------------------------------------- generation
def inference_model(model, cfg) -> None:
    """``--bf16`` inference (fairseq-generate, -interactive, -eval-lm, the hub interface): the
    model cast to bf16, fp32 islands kept fp32 (stock fairseq casts only for ``--fp16``)."""
    if bool(getattr(getattr(cfg, "common", None), "bf16", False)):
        model.to(torch.bfloat16)
        logger.info("fairseq_fp16: --bf16 inference: the model cast to bf16 (fp32 islands kept)")


def repair_ngram_blocker(generator):
    """``--no-repeat-ngram-size`` off CUDA: the plugin's NGramBlock for fairseq's fallback,
    which compares with the buffer's padding and blocks nothing (fairseq issue #5206)."""
    blocker = getattr(generator, "repeat_ngram_blocker", None)
    if blocker is not None and not getattr(blocker, "use_extension", True):
        generator.repeat_ngram_blocker = NGramBlock(blocker.no_repeat_ngram_size)
        logger.info("--no-repeat-ngram-size %d: repeats blocked by the plugin's NGramBlock "
                    "(fairseq's fallback off its CUDA kernel blocks none)",
                    blocker.no_repeat_ngram_size)
    return generator


# -------------------------------------------------------------------------------------- batches
def bucket_training_batches(task, dataset) -> None:
    """``--length-buckets``: the training set batches and collates in bucket shapes
    (:class:`~fairseq_fp16.batching.BucketedBatching`)."""
    context = run_context(task)
    choice = parse_length_buckets(context.flags.length_buckets)
    datasets = getattr(task, "datasets", None) or {}
    if choice is not None and dataset is datasets.get(context.train_subset):
        BucketedBatching.install(dataset, choice)


@contextmanager
def first_epoch_order(dataset, seed: int):
    """While open, ``dataset.ordered_indices()`` orders its examples with the epoch-1 seed.

    fairseq(-fixed) 0.12.3 orders the examples under ``numpy_seed(seed + epoch)`` with the epoch
    in which the iterator is made, and reuses its batches in later epochs: a run resumed in epoch 2
    or later would train on differently composed batches than the uninterrupted run. Ordered with
    the epoch-1 seed, every run sees the batches a fresh run makes."""
    ordered_indices = dataset.ordered_indices

    @wraps(ordered_indices)
    def ordered():
        with data_utils.numpy_seed(seed + 1):
            return ordered_indices()

    undo = swap_attribute(dataset, "ordered_indices", ordered)
    try:
        yield
    finally:
        undo()
