"""Patches of fairseq's distributed start-up: several processes on CPUs (torchrun, fairseq's
own spawn) and resume with torch >= 2.6."""

from __future__ import annotations

import atexit
import inspect
import io
import logging
import os
import socket
import sys
from typing import Optional

import torch
from fairseq.distributed import utils as distributed_utils
from omegaconf import open_dict
from torch.nn.parallel import DistributedDataParallel

from .registry import Patch
from .registry import original as _original

logger = logging.getLogger(__name__)



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
    return _original("fairseq.distributed.utils:infer_init_method")(cfg, force_distributed)


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
    return _original("fairseq.distributed.utils:call_main")(cfg, main, **kwargs)


def _spawned_main(i, main, cfg, kwargs):
    """One spawned CPU process: fairseq's distributed_main, then an exit without the
    interpreter's teardown.

    Even with the process groups destroyed (:func:`_distributed_main`), one gloo backend of a
    fairseq run stays alive, held outside Python, and its threads were torn down with the
    interpreter's static objects: now and then a finished process aborted there
    (``terminate called without an active exception``, SIGABRT). So a process that finished
    runs its ``atexit`` handlers, flushes its logs and streams and leaves with ``os._exit(0)``.
    An exception still ends it the usual way (spawn reports it).
    """
    # A spawned process starts afresh: unpickling this function imported the plugin, whose
    # import installs the patches (idempotent) before fairseq's distributed_main runs.
    from . import install

    install()
    distributed_utils.distributed_main(i, main, cfg, kwargs)
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _distributed_main(i, main, cfg, kwargs):
    """fairseq's distributed_main, then the process groups destroyed once training returned.

    fairseq 0.12 leaves them to the interpreter's exit, and keeps its global group in an
    attribute of ``get_global_group``. fairseq's own barrier ends its distributed_main, so
    every rank is done communicating by then.
    """
    _original("fairseq.distributed.utils:distributed_main")(i, main, cfg, kwargs)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if hasattr(distributed_utils.get_global_group, "_global_group"):
        del distributed_utils.get_global_group._global_group


def _distributed_init(cfg):
    common = getattr(cfg, "common", None)
    dt = getattr(cfg, "distributed_training", cfg)
    cpu = bool(getattr(common, "cpu", False)) or not torch.cuda.is_available()
    if cpu and dt.distributed_backend == "nccl":
        logger.info("fairseq_fp16: no CUDA: distributed backend gloo instead of nccl")
        dt.distributed_backend = "gloo"
    return _original("fairseq.distributed.utils:distributed_init")(cfg)


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


def _torch_ddp_with_device_ids(original) -> Optional[str]:
    """The name is torch's DDP, and fairseq builds it with ``device_ids=[args.device_id]``."""
    from fairseq.models import distributed_fairseq_model

    if original is not DistributedDataParallel:
        return f"it is {original!r}, not torch's DistributedDataParallel"
    if "device_ids=[args.device_id]" not in inspect.getsource(distributed_fairseq_model.DistributedFairseqModel):
        return "DistributedFairseqModel no longer passes device_ids=[args.device_id]"
    return None


PATCHES = [
    Patch("fairseq.distributed.utils:infer_init_method", group="repair", replacement=_infer_init_method,
          expects=["if cfg.distributed_init_method is not None or cfg.tpu:",
                   'for key in ["MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"]',
                   "cfg.distributed_num_procs = min("],
          why="under torchrun without a GPU fairseq computes rank % torch.cuda.device_count() "
              "(ZeroDivisionError) and without --distributed-world-size trains each process "
              "alone; world size, rank and local rank come from torchrun's environment, and "
              "--cpu --distributed-world-size N gets a free local port"),
    Patch("fairseq.distributed.utils:call_main", group="repair", replacement=_call_main,
          expects=["torch.cuda.device_count(),", "distributed_main(cfg.distributed_training.device_id"],
          why="fairseq spawns min(GPU count, N) processes, none on a CPU; without GPUs N are spawned"),
    Patch("fairseq.distributed.utils:distributed_init", group="repair", replacement=_distributed_init,
          expects=["backend=cfg.distributed_training.distributed_backend"],
          why="--distributed-backend defaults to nccl; without CUDA (or with --cpu) gloo is used"),
    Patch("fairseq.distributed.utils:distributed_main", group="repair", replacement=_distributed_main,
          expects=["cfg.distributed_training.device_id = i", 'kwargs.pop("start_rank", 0) + i',
                   "torch.distributed.barrier(get_global_group())"],
          why="the process groups were never destroyed; they are after fairseq's closing "
              "barrier, fairseq's cached global group included. The spawned CPU processes "
              "run fairseq's distributed_main too"),
    Patch("fairseq.distributed.utils:_broadcast_object_slow", group="repair", replacement=_broadcast_object_slow,
          expects=["broadcast(length, src=src_rank, group=group)", 'obj = torch.load(buffer, map_location="cpu")'],
          why="on resume rank 0 sends the loaded checkpoint state pickled; with torch >= 2.6 the "
              "others unpickle it weights-only and fail on the omegaconf config inside; the "
              "bytes come from rank 0, which loaded the file weights-only"),
    Patch("fairseq.models.distributed_fairseq_model:DistributedDataParallel", group="repair",
          replacement=DeviceAwareDDP, condition=_torch_ddp_with_device_ids,
          why="fairseq passes device_ids=[device_id], which DDP refuses for CPU modules; they "
              "are left out for a module that is not on a GPU"),
]
