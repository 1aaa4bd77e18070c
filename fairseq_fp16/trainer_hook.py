"""The plugin's single seam into fairseq: its trainer and its checkpoint files.

:func:`install` (run when the plugin is imported; idempotent) replaces three
methods of ``fairseq.trainer.Trainer``, keeping the originals:

``__init__``
    With ``--bf16``, fairseq's option parsing sets ``--tpu`` as well
    (``options.parse_args_and_arch``: "bf16 implies tpu"), which sends the run
    down the XLA path. The plugin trains bf16 on the selected device instead:
    the implied ``tpu`` is cleared unless ``--tpu`` was on the command line.

``_build_optimizer``
    Builds :class:`~fairseq_fp16.optim.mixed_precision.MixedPrecisionFairseqOptimizer`
    (fp32 master weights and the loss scaler under ``--fp16``/``--bf16``, a
    pass-through in fp32) instead of fairseq's ``FP16Optimizer``, which calls
    ``torch.cuda.current_device()`` and fails off CUDA. Parameters are tagged
    with their names first. Set-ups the wrapper does not cover
    (``--ddp-backend fully_sharded``, ``--memory-efficient-fp16/bf16``,
    ``--amp``, ``--use-bmuf``, ``--zero-sharding os``) use fairseq's original.

``train_step``
    fairseq's overflow handler ends with ``torch.tensor(0.0).cuda()``, which
    fails off CUDA. When our optimizer reported the overflow and the trainer
    is not on CUDA, that error is caught and the handler's remaining work
    (zero the gradients, log the scale, stop the ``train_wall`` timer) is
    done here; the update is skipped exactly as on a GPU. When the optimizer
    stops the run (``FloatingPointError``), fairseq re-runs the batch under
    its ``NanDetector``, whose backward hooks fail on the transformer's dict
    outputs with torch 2.x (``StopIteration``); the optimizer's own error,
    which says why the run stopped, is re-raised instead.

In ``fairseq.checkpoint_utils`` it replaces two names:

``PathManager`` (the copies of ``save_checkpoint``)
    fairseq writes the first checkpoint file atomically (``.tmp``, then
    rename) but *copies* it to ``checkpoint_last.pt``/``checkpoint_best.pt``
    in place, so a crash during the copy leaves a truncated
    ``checkpoint_last.pt`` that the next launch fails to resume from. The
    module's ``PathManager`` becomes a proxy whose ``copy`` writes a ``.tmp``
    file and renames it (local paths; other paths and calls delegate).

``load_checkpoint_to_cpu``
    (train resume and ``fairseq-generate``'s model loading) turns torch's
    errors into messages that name the file and what to do: a truncated or
    corrupt file, or a pickled global outside the allow-list of
    :mod:`fairseq_fp16.safe_load` (refused by weights-only loading, never run).

In ``fairseq.distributed.utils`` and ``fairseq.models.distributed_fairseq_model``
(multi-process training on CPUs, where stock fairseq 0.12 cannot start):

``infer_init_method``
    Under ``torchrun`` without a GPU, fairseq computes ``rank %
    torch.cuda.device_count()`` (``ZeroDivisionError``), and without
    ``--distributed-world-size`` it sees a world of 1 (the default is the GPU
    count) and trains each process alone. The world size, rank and local
    rank are taken from torchrun's environment. ``--cpu
    --distributed-world-size N`` without a launcher gets a free local port
    (fairseq asserts N <= the GPU count).
``call_main``
    spawns ``min(GPU count, N)`` processes: none on a CPU. Without GPUs it
    spawns N.
``distributed_init``
    ``--distributed-backend`` defaults to ``nccl``; without CUDA (or with
    ``--cpu``) the run uses ``gloo``.
``_broadcast_object_slow``
    on resume, rank 0 sends the loaded checkpoint state to the others pickled;
    with torch >= 2.6 they unpickle it in weights-only mode and fail on the
    ``omegaconf`` config inside (on GPUs too). The receivers unpickle it fully:
    the bytes come from rank 0, which loaded the file in weights-only mode.
``DistributedDataParallel``
    fairseq passes ``device_ids=[device_id]``, which DDP refuses for CPU
    modules; for a module that is not on a GPU they are left out.

And ``fairseq.options.parse_args_and_arch``: ``--fp16 --bf16`` together is
refused by argparse's ``parser.error`` naming both flags (fairseq itself
turns ``--bf16`` into ``--tpu`` first and then complains about ``--tpu``).

:func:`check_fairseq_internals` checks the statements of fairseq's source
these replacements rely on; :func:`install` calls it and fails loudly if
fairseq changed.
"""

from __future__ import annotations

import inspect
import io
import logging
import os
import pickle
import re
import shutil
import socket
import sys
from itertools import chain
from typing import Callable, Dict

import torch
from fairseq import checkpoint_utils, options
from fairseq import trainer as fairseq_trainer
from fairseq.distributed import utils as distributed_utils
from fairseq.file_io import PathManager
from fairseq.logging import metrics
from fairseq.models import distributed_fairseq_model
from fairseq.optim import lr_scheduler
from omegaconf import open_dict
from torch.nn.parallel import DistributedDataParallel

from . import safe_load
from .core.master_weights import tag_param_names
from .optim.mixed_precision import MixedPrecisionFairseqOptimizer, precision_of

logger = logging.getLogger(__name__)

__all__ = ["install", "uninstall", "is_installed", "check_fairseq_internals"]

_ORIGINALS: Dict[str, Callable] = {}
_MARK = "_fairseq_fp16_hook"

#: Statements of fairseq 0.12's trainer that the replacements depend on.
EXPECTED_SOURCE = {
    "__init__": ["self.tpu = cfg.common.tpu", "self._model = self._model.half()"],
    "_build_optimizer": [
        "optim.FP16Optimizer.build_optimizer(self.cfg, params)",
        "self._lr_scheduler = lr_scheduler.build_lr_scheduler(",
        "self._lr_scheduler.step_update(0)",
    ],
    "train_step": [
        "except OverflowError as e:",
        "grad_norm = torch.tensor(0.0).cuda()",
        'metrics.log_stop_time("train_wall")',
        "self.optimizer.scaler.loss_scale",
    ],
    "state_dict": ['"optimizer_name": self.optimizer.__class__.__name__'],
}
#: Statements of fairseq 0.12's checkpoint_utils that the wrappers depend on.
EXPECTED_CHECKPOINT_SOURCE = {
    "save_checkpoint": ["PathManager.copy(", "trainer.save_checkpoint(checkpoints[0], extra_state)"],
    "load_checkpoint_to_cpu": ["torch.load(f, map_location=torch.device(\"cpu\"))"],
}
#: Statements of fairseq 0.12's distributed code that the CPU replacements depend on.
EXPECTED_DISTRIBUTED_SOURCE = {
    "call_main": ["torch.cuda.device_count(),", "distributed_main(cfg.distributed_training.device_id"],
    "distributed_init": ["backend=cfg.distributed_training.distributed_backend"],
    "distributed_main": ["cfg.distributed_training.device_id = i", 'kwargs.pop("start_rank", 0) + i'],
    "_broadcast_object_slow": ["broadcast(length, src=src_rank, group=group)",
                               'obj = torch.load(buffer, map_location="cpu")'],
}


def check_fairseq_internals(trainer_cls=None) -> None:
    """Raise ``RuntimeError`` if fairseq's Trainer is not what the hook expects."""
    cls = trainer_cls or fairseq_trainer.Trainer
    for name, needles in EXPECTED_SOURCE.items():
        fn = _ORIGINALS.get(name) or getattr(cls, name, None)
        if fn is None:
            raise RuntimeError(f"fairseq_fp16: fairseq.trainer.Trainer has no {name}()")
        _check_source(f"fairseq.trainer.Trainer.{name}", fn, needles)
    for name, needles in EXPECTED_CHECKPOINT_SOURCE.items():
        fn = _ORIGINALS.get(name) or getattr(checkpoint_utils, name, None)
        if fn is None:
            raise RuntimeError(f"fairseq_fp16: fairseq.checkpoint_utils has no {name}()")
        _check_source(f"fairseq.checkpoint_utils.{name}", fn, needles)
    for name, needles in EXPECTED_DISTRIBUTED_SOURCE.items():
        fn = _ORIGINALS.get(name) or getattr(distributed_utils, name, None)
        if fn is None:
            raise RuntimeError(f"fairseq_fp16: fairseq.distributed.utils has no {name}()")
        _check_source(f"fairseq.distributed.utils.{name}", fn, needles)


def _check_source(qualname: str, fn: Callable, needles) -> None:
    src = inspect.getsource(inspect.unwrap(fn))
    for needle in needles:
        if needle not in src:
            raise RuntimeError(
                f"fairseq_fp16: {qualname} changed ({needle!r} not found); "
                "this plugin supports fairseq 0.12"
            )


def _plugin_optimizer_applies(cfg) -> bool:
    dt = cfg.distributed_training
    return not (
        dt.ddp_backend == "fully_sharded"
        or cfg.common.memory_efficient_fp16
        or cfg.common.memory_efficient_bf16
        or cfg.common.amp
        or cfg.optimization.use_bmuf
        or dt.zero_sharding != "none"
    )


def _tpu_requested() -> bool:
    return any(a == "--tpu" for a in sys.argv[1:])


def _init(self, cfg, task, model, criterion, quantizer=None):
    common = getattr(cfg, "common", None)
    if common is not None and common.bf16 and common.tpu and not _tpu_requested():
        logger.info("fairseq_fp16: --bf16 on %s, not on TPU (pass --tpu for XLA)",
                    "CPU" if common.cpu else "the default device")
        common.tpu = False
    _ORIGINALS["__init__"](self, cfg, task, model, criterion, quantizer)


def _build_optimizer(self):
    if not _plugin_optimizer_applies(self.cfg):
        logger.info("fairseq_fp16: this set-up uses fairseq's own optimizer wrapper")
        return _ORIGINALS["_build_optimizer"](self)
    named = [
        (n, p)
        for n, p in chain(self.model.named_parameters(), self.criterion.named_parameters())
        if p.requires_grad
    ]
    tag_param_names(named)
    self._optimizer = MixedPrecisionFairseqOptimizer(
        self.cfg, [p for _, p in named], precision_of(self.cfg)
    )
    self._optimizer.watch_forward(self._model)
    self._lr_scheduler = lr_scheduler.build_lr_scheduler(self.cfg.lr_scheduler, self.optimizer)
    self._lr_scheduler.step_update(0)


def _train_step(self, samples, raise_oom=False):
    try:
        return _ORIGINALS["train_step"](self, samples, raise_oom)
    except Exception as e:
        opt = self._optimizer
        stop = getattr(opt, "stop_error", None)
        if stop is not None:
            if e is not stop:  # fairseq's NanDetector re-run of the batch failed
                logger.warning("fairseq's NanDetector re-run failed (%s: %s); the reason the "
                               "run stopped is:", type(e).__name__, e)
            raise stop from None
        if not isinstance(e, (AssertionError, RuntimeError)):
            raise
        if self.cuda or not getattr(opt, "overflow_pending", False):
            raise
    # fairseq's OverflowError handler failed at torch.tensor(0.0).cuda();
    # finish it as it would have on a GPU.
    with metrics.aggregate("train"):
        self.zero_grad()
        if self.cfg.common.fp16:
            metrics.log_scalar(
                "loss_scale", self.optimizer.scaler.loss_scale, priority=700, round=4, weight=0
            )
        metrics.log_stop_time("train_wall")
    return None


_REPLACEMENTS = {"__init__": _init, "_build_optimizer": _build_optimizer, "train_step": _train_step}


# ------------------------------------------------------------------ checkpoints
def atomic_copy(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` through ``dst.tmp`` and a rename: ``dst`` is old or whole."""
    tmp = dst + ".tmp"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


class _AtomicCopyPathManager:
    """fairseq's ``PathManager`` with an atomic ``copy`` for local files."""

    def __getattr__(self, name):
        return getattr(PathManager, name)

    @staticmethod
    def copy(src_path: str, dst_path: str, overwrite: bool = False) -> bool:
        if "://" in src_path or "://" in dst_path:  # a remote store: fairseq's copy
            return PathManager.copy(src_path, dst_path, overwrite=overwrite)
        if os.path.exists(dst_path) and not overwrite:
            return False
        atomic_copy(src_path, dst_path)
        return True


_UNSAFE_GLOBAL = re.compile(r"GLOBAL ([\w.]+)|Unsupported global: GLOBAL ([\w.]+)")


def describe_load_error(path: str, err: BaseException) -> str:
    """What went wrong loading checkpoint ``path``, and what to do."""
    text = str(err)
    if isinstance(err, pickle.UnpicklingError) and "GLOBAL" in text:
        m = _UNSAFE_GLOBAL.search(text)
        name = (m.group(1) or m.group(2)) if m else "?"
        allowed = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in safe_load.FAIRSEQ_CHECKPOINT_GLOBALS)
        return (
            f"fairseq_fp16: refused to load checkpoint {path}: it holds the pickled global "
            f"{name}, outside the allow-list of fairseq checkpoints ({allowed}); weights-only "
            "loading stopped before running anything. fairseq-train never writes such a "
            "global: the file was made or altered by another program"
        )
    others = []
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(folder):
        others = sorted(  # newest first
            (f for f in os.listdir(folder)
             if f.endswith(".pt") and os.path.join(folder, f) != os.path.abspath(path)),
            key=lambda f: -os.path.getmtime(os.path.join(folder, f)),
        )
    hint = (f"other checkpoints in {folder}: {', '.join(others)} (resume from one with "
            "--restore-file), or move the file away to start over") if others else \
        "move the file away to start over"
    first_line = text.strip().splitlines()[0].split(". ")[0][:200] if text.strip() else ""
    return (
        f"fairseq_fp16: checkpoint {path} is truncated or corrupt "
        f"({type(err).__name__}: {first_line}); nothing was loaded or overwritten; {hint}"
    )


#: torch's checkpoint readers: an exception raised in them means the bytes could not be read.
_TORCH_READERS = ("serialization.py", "_weights_only_unpickler.py")


def _raised_reading(err: BaseException) -> bool:
    """Whether ``err`` was raised while ``torch.load`` read the file.

    Unpickling damaged bytes fails in many ways (``UnpicklingError`` mostly,
    but also ``IndexError``, ``KeyError``, ``UnicodeDecodeError``, ``EOFError``
    from the weights-only unpickler), so the place decides, not the type.
    """
    tb = err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code.co_filename
        if os.path.basename(code) in _TORCH_READERS and os.path.basename(os.path.dirname(code)) == "torch":
            return True
        tb = tb.tb_next
    return False


def _load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
    try:
        return _ORIGINALS["load_checkpoint_to_cpu"](path, arg_overrides, load_on_all_ranks)
    except Exception as e:
        damaged = isinstance(e, (pickle.UnpicklingError, EOFError)) or _raised_reading(e)
        if isinstance(e, RuntimeError) and not any(
            k in str(e) for k in ("PytorchStreamReader", "zip archive", "unexpected EOF")
        ):
            damaged = False  # e.g. a device or version problem of a readable file
        if not damaged:
            raise
        raise RuntimeError(describe_load_error(str(path), e)) from e


_CHECKPOINT_REPLACEMENTS = {"load_checkpoint_to_cpu": _load_checkpoint_to_cpu}


# ----------------------------------------------------------------- distributed
TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def _no_gpu() -> bool:
    return torch.cuda.device_count() == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def _infer_init_method(cfg, force_distributed=False):
    launched = all(k in os.environ for k in TORCHRUN_ENV)
    if cfg.distributed_init_method is None and not cfg.tpu and _no_gpu():
        if launched:
            world = int(os.environ["WORLD_SIZE"])
            if cfg.distributed_world_size not in (1, world):
                logger.warning("fairseq_fp16: --distributed-world-size %d, but torchrun started %d "
                               "processes: using %d", cfg.distributed_world_size, world, world)
            with open_dict(cfg):
                cfg.distributed_world_size = world
                cfg.distributed_rank = int(os.environ["RANK"])
                cfg.device_id = int(os.environ.get("LOCAL_RANK", 0))
                cfg.distributed_init_method = "env://"
                cfg.distributed_no_spawn = True
                cfg.distributed_num_procs = 1
            return
        if cfg.distributed_world_size > 1 and "SLURM_JOB_ID" not in os.environ:
            with open_dict(cfg):
                port = cfg.distributed_port if cfg.distributed_port > 0 else _free_port()
                cfg.distributed_init_method = f"tcp://localhost:{port}"
                cfg.distributed_num_procs = cfg.distributed_world_size
            return
    return _ORIGINALS["infer_init_method"](cfg, force_distributed)


def _call_main(cfg, main, **kwargs):
    dt = cfg.distributed_training
    if dt.distributed_init_method is None:
        _infer_init_method(dt)
    if _no_gpu() and dt.distributed_init_method is not None and not dt.distributed_no_spawn:
        kwargs["start_rank"] = dt.distributed_rank
        dt.distributed_rank = None  # distributed_main assigns start_rank + process index
        torch.multiprocessing.spawn(fn=_spawned_main, args=(main, cfg, kwargs),
                                    nprocs=dt.distributed_world_size, join=True)
        return None
    return _ORIGINALS["call_main"](cfg, main, **kwargs)


def _spawned_main(i, main, cfg, kwargs):
    # A spawned process starts afresh: unpickling this function imported the plugin, whose
    # import installs the hook (install() is idempotent) before fairseq's distributed_main runs.
    install()
    distributed_utils.distributed_main(i, main, cfg, kwargs)


def _distributed_init(cfg):
    common = getattr(cfg, "common", None)
    dt = getattr(cfg, "distributed_training", cfg)
    cpu = bool(getattr(common, "cpu", False)) or not torch.cuda.is_available()
    if cpu and dt.distributed_backend == "nccl":
        logger.info("fairseq_fp16: no CUDA: distributed backend gloo instead of nccl")
        dt.distributed_backend = "gloo"
    return _ORIGINALS["distributed_init"](cfg)


def _broadcast_object_slow(obj, src_rank, group, dist_device):
    """fairseq's pickled broadcast (length, then bytes), unpickled fully on the receivers.

    fairseq sends the checkpoint state that rank 0 loaded to the other ranks this way; with
    torch >= 2.6 the receivers' ``torch.load`` runs in weights-only mode and refuses the
    ``omegaconf`` config inside (so every distributed resume failed). The bytes come from rank 0
    of this job, which built them from a checkpoint it loaded in weights-only mode: they hold
    nothing that was not already in that process.
    """
    if distributed_utils.get_rank(group) == src_rank:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(dist_device)
        length = torch.tensor([data.numel()], device=dist_device)
        distributed_utils.broadcast(length, src=src_rank, group=group)
        distributed_utils.broadcast(data, src=src_rank, group=group)
        return obj
    length = torch.zeros(1, dtype=torch.long, device=dist_device)
    distributed_utils.broadcast(length, src=src_rank, group=group)
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=dist_device)
    distributed_utils.broadcast(data, src=src_rank, group=group)
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), map_location="cpu", weights_only=False)


class DeviceAwareDDP(DistributedDataParallel):
    """torch's DDP, without ``device_ids`` for a module that is not on a GPU."""

    def __init__(self, module, device_ids=None, output_device=None, **kwargs):
        if next(module.parameters()).device.type != "cuda":
            device_ids = output_device = None
        super().__init__(module, device_ids=device_ids, output_device=output_device, **kwargs)


_DISTRIBUTED_REPLACEMENTS = [
    (distributed_utils, "infer_init_method", _infer_init_method),
    (distributed_utils, "call_main", _call_main),
    (distributed_utils, "distributed_init", _distributed_init),
    (distributed_utils, "_broadcast_object_slow", _broadcast_object_slow),
    (distributed_fairseq_model, "DistributedDataParallel", DeviceAwareDDP),
]


# --------------------------------------------------------------------- options
EXCLUSIVE_FLAGS = ("--fp16", "--bf16")


def _parse_args_and_arch(parser, input_args=None, *args, **kwargs):
    argv = sys.argv[1:] if input_args is None else list(input_args)
    if all(flag in argv for flag in EXCLUSIVE_FLAGS):
        parser.error("--fp16 and --bf16 are exclusive: pick one precision (fairseq_fp16)")
    return _ORIGINALS["parse_args_and_arch"](parser, input_args, *args, **kwargs)


def is_installed() -> bool:
    return bool(getattr(fairseq_trainer.Trainer, _MARK, False))


def install() -> None:
    """Replace the Trainer methods above (idempotent)."""
    cls = fairseq_trainer.Trainer
    if is_installed():
        return
    check_fairseq_internals(cls)
    for name, fn in _REPLACEMENTS.items():
        _ORIGINALS[name] = getattr(cls, name)
        setattr(cls, name, fn)
    for name, fn in _CHECKPOINT_REPLACEMENTS.items():
        _ORIGINALS[name] = getattr(checkpoint_utils, name)
        setattr(checkpoint_utils, name, fn)
    _ORIGINALS["PathManager"] = checkpoint_utils.PathManager
    checkpoint_utils.PathManager = _AtomicCopyPathManager()
    _ORIGINALS["parse_args_and_arch"] = options.parse_args_and_arch
    options.parse_args_and_arch = _parse_args_and_arch
    for module, name, fn in _DISTRIBUTED_REPLACEMENTS:
        _ORIGINALS[name] = getattr(module, name)
        setattr(module, name, fn)
    setattr(cls, _MARK, True)


def uninstall() -> None:
    """Restore fairseq's methods (tests use it to compare with stock fairseq)."""
    cls = fairseq_trainer.Trainer
    if not is_installed():
        return
    for name in _REPLACEMENTS:
        setattr(cls, name, _ORIGINALS[name])
    for name in _CHECKPOINT_REPLACEMENTS:
        setattr(checkpoint_utils, name, _ORIGINALS[name])
    checkpoint_utils.PathManager = _ORIGINALS["PathManager"]
    options.parse_args_and_arch = _ORIGINALS["parse_args_and_arch"]
    for module, name, _ in _DISTRIBUTED_REPLACEMENTS:
        setattr(module, name, _ORIGINALS[name])
    delattr(cls, _MARK)
