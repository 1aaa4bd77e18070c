"""The plugin's flags: one dataclass, declared for every task, checked as each task is built.

:class:`PrecisionFlags` holds the flags of the precision features (loss scaling, fp32 islands,
the fused loss, the attention path, compiled layers, the CPU matrix-product mode, batch shapes
and the diagnostics). With the plugin loaded they belong to every task
(:mod:`fairseq_fp16.patches.flags`): a dataclass task's config is extended with them
(:func:`with_precision_flags`), so they are ``--flags`` of ``fairseq-train`` and keys under
``task:`` in a hydra config, and every command's parser gets them as an argument group of
their own (:func:`add_precision_group`), which is how a legacy task (``add_args``, its config
the whole ``argparse.Namespace``) gets them. The features and the optimizer read them from the
task's config (:func:`flag`, :func:`task_config`); :func:`validate_precision_flags` refuses bad
values before a task reads any data.
"""

# no `from __future__ import annotations`: fairseq reads the fields' types as types
import argparse
import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass
from omegaconf import II

from .core.buckets import parse_length_buckets
from .core.half_matmul import HALF_MATMUL_CHOICES
from .core.loss_scaler import check_scale_range, parse_loss_scale
from .fused_criterion import FUSED_LOSS_CHOICES
from .precision import EXCLUSIVE

logger = logging.getLogger(__name__)

__all__ = ["ATTENTION_PATHS", "CPU_DROPOUT", "DIAGNOSTICS_FILES", "GROUP", "FairseqValues", "PrecisionFlags",
           "add_precision_group", "flag", "resolve_attention_path", "task_config",
           "validate_precision_flags", "with_precision_flags"]

#: the title of the flags' argument group in ``--help``
GROUP = "fairseq_fp16: mixed precision"
ATTENTION_PATHS = ("auto", "torch", "fairseq")
CPU_DROPOUT = ("auto", "counter", "torch")


@dataclass
class PrecisionFlags(FairseqDataclass):
    """The plugin's flags (each field is ``--field-name``)."""

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
            "--bf16, off for fp32 (fairseq's own loss). on takes large chunks with few passes "
            "over memory on CUDA (stream); on the CPU, kernels made by torch.compile (compiled) "
            "for logits of 2**20 elements or more where they build, cache-sized chunks (cache) "
            "otherwise; with --compile-layers, compiled everywhere. stream, cache or compiled "
            "turns it on with that path on any device"
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
    cpu_dropout: ChoiceEnum(list(CPU_DROPOUT)) = field(  # type: ignore[valid-type]
        default="auto",
        metadata={
            "help": "dropout masks of a model trained on the CPU: counter = each element's "
            "keep decision hashed from its index and a seed drawn from torch's generator, the "
            "mask, scaling and rounding in one compiled pass (torch.compile) and recomputed in "
            "the backward pass instead of kept; torch = torch's bernoulli_ masks (a hundred "
            "times slower on large tensors). auto: counter for tensors of 32,768 elements or "
            "more where torch.compile can build it, torch's for smaller ones. CUDA is never "
            "affected"
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
    compile_step: bool = field(
        default=False,
        metadata={
            "help": "--fp16/--bf16 with --optimizer fp16_adam: each large parameter's update in one "
            "loop compiled by torch.compile, from its half gradient to its fp32 master, moments and "
            "half weight (32 bytes a parameter moved instead of 44 in four eager passes; tensors "
            "under 16,384 elements and fp32 ones keep those passes). The run's start pays the "
            "compile"
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


@dataclass
class FairseqValues(FairseqDataclass):
    """fairseq's own flags that the checks and the features read from a task's config, as a
    dataclass task's config refers to them (a legacy task's ``Namespace`` has them all). No
    ``--flag`` is made for them: fairseq declares each."""

    fp16: bool = II("common.fp16")
    bf16: bool = II("common.bf16")
    amp: bool = II("common.amp")
    cpu: bool = II("common.cpu")
    fp16_init_scale: int = II("common.fp16_init_scale")
    fp16_scale_window: Optional[int] = II("common.fp16_scale_window")
    save_dir: str = II("checkpoint.save_dir")
    train_subset: str = II("dataset.train_subset")


_EXTENDED: Dict[type, type] = {}


def with_precision_flags(config: type) -> type:
    """``config`` (a task's dataclass) with the fields of :class:`PrecisionFlags` and
    :class:`FairseqValues` added: a subclass of all three, of ``config``'s name, made once.
    A field ``config`` declares itself keeps its declaration."""
    if issubclass(config, PrecisionFlags):
        return config
    extended = _EXTENDED.get(config)
    if extended is None:
        extended = dataclasses.make_dataclass(config.__name__, [],
                                              bases=(config, PrecisionFlags, FairseqValues))
        extended.__module__, extended.__qualname__ = config.__module__, config.__qualname__
        extended.__doc__ = f"{config.__name__} with the flags of fairseq_fp16 (PrecisionFlags)"
        _EXTENDED[config] = extended
    return extended


def add_precision_group(parser: argparse.ArgumentParser) -> None:
    """Add the flags to ``parser`` as the argument group :data:`GROUP` (idempotent).

    Raises:
        RuntimeError: when the parser already has one of the flags from elsewhere (argparse
            would keep that one, and the plugin's would go unseen).
    """
    if any(group.title == GROUP for group in parser._action_groups):
        return
    names = ["--" + name.replace("_", "-") for name in PrecisionFlags.__dataclass_fields__ if name != "_name"]
    taken = [name for name in names if name in parser._option_string_actions]
    if taken:
        raise RuntimeError(f"fairseq_fp16: the parser already has {', '.join(taken)}; the plugin's "
                           "flags of that name cannot be added")
    gen_parser_from_dataclass(parser.add_argument_group(GROUP), PrecisionFlags())


def task_config(task) -> Any:
    """Where ``task`` keeps its flags: ``task.cfg``, or ``task.args`` for a legacy task (whose
    ``cfg`` is None)."""
    cfg = getattr(task, "cfg", None)
    return cfg if cfg is not None else getattr(task, "args", None)


def _value(cfg, name: str, default):
    """``cfg.<name>``; ``default`` where the configuration lacks it or cannot resolve it (a
    configuration from an older checkpoint, or a task's without fairseq's ``common``)."""
    try:
        value = getattr(cfg, name, default)
    except Exception:  # omegaconf: an interpolation with nothing to point at
        return default
    if isinstance(value, str) and value.startswith("${"):  # a bare dataclass
        return default
    return value


def flag(cfg, name: str, default=None):
    """``cfg.<name>``, or ``default`` where it is missing, unresolvable or None."""
    value = _value(cfg, name, default)
    return default if value is None else value


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


def validate_precision_flags(cfg) -> None:
    """Refuse bad values of the plugin's flags (and of fairseq's ``--fp16-init-scale`` and
    ``--fp16-scale-window``) in a task's config; a flag the config lacks has its default.

    Raises:
        ValueError: naming the flag and its valid values.
    """
    fp16, bf16 = bool(flag(cfg, "fp16", False)), bool(flag(cfg, "bf16", False))
    if fp16 and bf16:
        raise ValueError(EXCLUSIVE)
    if bool(flag(cfg, "amp", False)) and (fp16 or bf16):
        raise ValueError(f"--amp and {'--fp16' if fp16 else '--bf16'} are exclusive: --amp keeps "
                         "fp32 weights and runs the forward under torch.autocast (bf16 on the CPU), "
                         f"{'--fp16' if fp16 else '--bf16'} casts the model and keeps fp32 master "
                         "weights; pick one")
    loss_scale = flag(cfg, "loss_scale")
    scale = parse_loss_scale(loss_scale)
    hysteresis = _value(cfg, "loss_scale_hysteresis", 1)
    if hysteresis is None or int(hysteresis) < 1:
        raise ValueError(
            "--loss-scale-hysteresis must be an integer >= 1 (1 backs off at every "
            f"overflow), got {hysteresis!r}"
        )
    overflows = _value(cfg, "max_consecutive_overflows", 10)
    if overflows is None or int(overflows) < 0:
        raise ValueError(
            "--max-consecutive-overflows must be an integer >= 0 (0 = never stop), "
            f"got {overflows!r}"
        )
    regex = flag(cfg, "fp32_modules")
    if regex:
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(
                f"--fp32-modules is not a valid regular expression: {regex!r} ({e})"
            ) from None
    _validate_loss_scale_flags(cfg)
    _validate_diagnostics_flags(cfg, fp16 or bf16)
    resolve_attention_path(str(flag(cfg, "attention_path", "auto")), False, False)
    _validate_batch_shape_flags(cfg)
    if bf16 and scale:
        logger.warning(
            "--loss-scale %s with --bf16: bf16 has fp32's exponent range and needs no "
            "loss scaling; the scale is applied anyway", loss_scale,
        )


def _validate_loss_scale_flags(cfg) -> None:
    """fairseq's ``--fp16-init-scale`` and ``--fp16-scale-window``, which fairseq takes as they
    come: 0 fails only when the scaler is built (or, in fairseq's own scaler, at the first
    scale update)."""
    init = flag(cfg, "fp16_init_scale")
    if init is not None and not float(init) >= 1:
        raise ValueError(f"--fp16-init-scale must be an integer >= 1 (the dynamic loss scale's "
                         f"first value; fairseq's default 128), got {init!r}")
    if init is not None:
        check_scale_range(float(init), init, "--fp16-init-scale")
    window = flag(cfg, "fp16_scale_window")
    if window is not None and int(window) < 1:
        raise ValueError("--fp16-scale-window must be an integer >= 1 (clean updates before the "
                         "dynamic loss scale grows; unset: 2**14 / (world size x update-freq)), "
                         f"got {window!r}")


def _validate_batch_shape_flags(cfg) -> None:
    """``--length-buckets`` and ``--cuda-graphs``, which needs it and ``--compile-layers``."""
    buckets = parse_length_buckets(flag(cfg, "length_buckets", "off"))
    if buckets is not None and int(flag(cfg, "num_batch_buckets", 0) or 0) > 0:
        raise ValueError("--length-buckets and fairseq's --num-batch-buckets both pad lengths to "
                         "buckets; pass one of them")
    if flag(cfg, "cuda_graphs", False):
        if not flag(cfg, "compile_layers", False):
            raise ValueError("--cuda-graphs runs the compiled layers as CUDA graphs; add "
                             "--compile-layers")
        if buckets is None:
            raise ValueError("--cuda-graphs needs --length-buckets N or auto: a graph is recorded "
                             "for each batch shape, and fairseq's own batches come in hundreds")


#: each diagnostics file flag and the interval flag that turns it on (None: the file alone does)
DIAGNOSTICS_FILES = {"scale_trace": None, "precision_stats": "precision_stats_interval",
                     "precision_divergence": "precision_divergence_interval"}


def _validate_diagnostics_flags(cfg, half: bool) -> None:
    """The diagnostics' intervals and files; in an fp32 run, a warning for each flag that
    does nothing there."""
    for interval in ("precision_stats_interval", "precision_divergence_interval"):
        value = flag(cfg, interval, 0)
        if int(value) < 0:
            raise ValueError(f"--{interval.replace('_', '-')} must be >= 0 (0 = off), got {value!r}")
    for name, interval in DIAGNOSTICS_FILES.items():
        path = flag(cfg, name)
        option = "--" + name.replace("_", "-")
        if not path:
            continue
        if os.path.isdir(path) or path.endswith(("/", os.sep)):
            raise ValueError(f"{option} must name a file (it is written as JSON lines), got the "
                             f"directory {path!r}")
        if interval and not int(flag(cfg, interval, 0)):
            # a warning, not a refusal: a checkpoint trained so still builds its task
            ioption = "--" + interval.replace("_", "-")
            logger.warning("%s %s: nothing is written without %s N (N >= 1: every N updates)",
                           option, path, ioption)
    if not half:
        if flag(cfg, "scale_trace"):
            logger.warning("--scale-trace: an fp32 run has no loss scale and skips no update; "
                           "nothing is written (it traces --fp16/--bf16 runs)")
        if int(flag(cfg, "precision_stats_interval", 0)):
            logger.warning("--precision-stats-interval: an fp32 run has no half gradients and no "
                           "fp32 master weights; nothing is measured (it measures --fp16/--bf16 runs)")
