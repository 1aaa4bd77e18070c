"""Patches of fairseq's task base classes: the precision features for every task.

fairseq's tasks build the model, the criterion and the generator, make the batch iterator and run
the train, valid and inference steps in methods of ``FairseqTask`` (and ``LegacyFairseqTask``)
that most tasks inherit or call through ``super()``. Each replacement here calls fairseq's method
and the feature of :mod:`fairseq_fp16.features` that belongs to it, so any task run with the
plugin loaded gets them.
"""

from __future__ import annotations

import inspect
from typing import Optional

from ..core.half_matmul import half_matmul_context
from ..features import (
    bucket_training_batches,
    cpu_autocast,
    divergence_due,
    first_epoch_order,
    fused_criterion,
    inference_model,
    measure_divergence,
    native_products_check,
    prepare_model,
    repair_ngram_blocker,
    task_state,
)
from .registry import Patch
from .registry import original as _original

__all__ = ["PATCHES"]

BASE = "fairseq.tasks.fairseq_task:FairseqTask"
LEGACY = "fairseq.tasks.fairseq_task:LegacyFairseqTask"
PREPARE = "fairseq.models.fairseq_model:BaseFairseqModel.prepare_for_inference_"


def _build_model_of(target):
    def build_model(self, cfg, from_checkpoint=False):
        return prepare_model(self, _original(target)(self, cfg, from_checkpoint))

    return build_model


def _build_criterion_of(target):
    def build_criterion(self, cfg, *args, **kwargs):
        return fused_criterion(self, _original(target)(self, cfg, *args, **kwargs), cfg)

    return build_criterion


def _train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
    state = task_state(self)
    with half_matmul_context(state.fp32_accumulate):
        if divergence_due(state, sample, optimizer, update_num, ignore_grad):
            measure_divergence(state, sample, model, optimizer, update_num)
        with native_products_check(state, "training step"), cpu_autocast(state, optimizer):
            return _original(f"{BASE}.train_step")(self, sample, model, criterion, optimizer,
                                                   update_num, ignore_grad)


def _valid_step(self, *args, **kwargs):
    with half_matmul_context(task_state(self).fp32_accumulate):
        return _original(f"{BASE}.valid_step")(self, *args, **kwargs)


def _inference_step(self, *args, **kwargs):
    state = task_state(self)
    with half_matmul_context(state.fp32_accumulate), native_products_check(state, "generation step"):
        return _original(f"{BASE}.inference_step")(self, *args, **kwargs)


def _build_generator(self, models, args, *rest, **kwargs):
    return repair_ngram_blocker(_original(f"{BASE}.build_generator")(self, models, args, *rest, **kwargs))


def _prepare_for_inference_(self, cfg):
    inference_model(self, cfg)
    return _original(PREPARE)(self, cfg)


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
    """fairseq's batch iterator: with ``--length-buckets`` the training set's batches in a few
    shapes; a reused iterator's examples in the epoch-1 order."""
    bucket_training_batches(self, dataset)
    make = _original(f"{BASE}.get_batch_iterator")
    if not _reused_for_every_epoch(self, dataset, args, kwargs):
        return make(self, dataset, *args, **kwargs)
    with first_epoch_order(dataset, _argument(args, kwargs, "seed", SEED_POSITION, 1)):
        return make(self, dataset, *args, **kwargs)


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
          why="--no-repeat-ngram-size off CUDA gets a blocker that blocks (fairseq's fallback "
              "compares with the buffer's padding and blocks nothing)"),
    Patch(PREPARE, group="precision", replacement=_prepare_for_inference_,
          expects=["self.make_generation_fast_(**kwargs)"],
          why="fairseq-generate, -interactive and -eval-lm cast the model for --fp16 only; with "
              "--bf16 the model is cast to bf16 as it is prepared for inference"),
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
