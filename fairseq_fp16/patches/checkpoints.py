"""Patches of ``fairseq.checkpoint_utils``: atomic copies of checkpoint files, and errors that
name a damaged or refused checkpoint file."""

from __future__ import annotations

import contextvars
import inspect
import logging
import os
import pickle
import re
import shutil
from typing import List, Optional, Tuple

import torch

from fairseq.file_io import PathManager

from .. import safe_load
from ..ema import rebuild_ema_model
from ..optim.stock_state import prepare_for_resume
from ..tasks.translation_fp16 import check_resumed_batches
from .registry import Patch
from .registry import original as _original
from .trainer import plugin_optimizer_applies

logger = logging.getLogger(__name__)

class DamagedCheckpointError(RuntimeError):
    """A checkpoint file whose bytes torch could not read (truncated, corrupt) or refused."""


COPY = "fairseq.checkpoint_utils:PathManager"
SAVE = "fairseq.checkpoint_utils:save_checkpoint"
LOAD = "fairseq.checkpoint_utils:load_checkpoint_to_cpu"



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
    state = _read_checkpoint(path, arg_overrides, load_on_all_ranks)
    trainer = RESUMING.get()
    if trainer is not None and plugin_optimizer_applies(trainer.cfg):
        stock = prepare_for_resume(state)
        if stock:
            logger.info("fairseq_fp16: %s was written by stock fairseq (%s): its optimizer state "
                        "is read into the plugin's optimizer", path, stock)
    return state


def unreadable(err: BaseException) -> bool:
    """Whether ``err``, raised loading a checkpoint, means the file's bytes are damaged or not a
    checkpoint at all (not a device or version problem of a readable file)."""
    damaged = isinstance(err, (pickle.UnpicklingError, EOFError)) or _raised_reading(err)
    if isinstance(err, RuntimeError) and not any(
        k in str(err) for k in ("PytorchStreamReader", "zip archive", "unexpected EOF")
    ):
        return False
    return damaged


def _read_checkpoint(path, arg_overrides=None, load_on_all_ranks=False):
    try:
        return _original(LOAD)(path, arg_overrides, load_on_all_ranks)
    except Exception as e:
        if not unreadable(e):
            raise
        raise DamagedCheckpointError(describe_load_error(str(path), e)) from e


LAST = "checkpoint_last.pt"


def saved_num_updates(path: str) -> Optional[int]:
    """The updates a checkpoint file was saved at (None: unreadable). The file is mapped, not
    read: only its pickled structure is unpickled, weights-only."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return int(state["optimizer_history"][-1]["num_updates"])
    except Exception:
        return None


def intact_alternatives(path: str) -> List[Tuple[str, Optional[int]]]:
    """The other checkpoint files beside ``path``, the candidates to resume from, with the
    updates each was saved at: the most updates first (a ``checkpoint_best.pt`` saved at the
    last update is as new as the lost ``checkpoint_last.pt``); among equals, the file a save
    wrote before the copies fairseq makes of it (``checkpoint_best*.pt``), then the newer;
    unreadable files last."""
    folder = os.path.dirname(os.path.abspath(path))
    found = []
    for f in os.listdir(folder):
        full = os.path.join(folder, f)
        if f.endswith(".pt") and full != os.path.abspath(path):
            found.append((full, saved_num_updates(full), f.startswith("checkpoint_best"),
                          os.path.getmtime(full)))
    found.sort(key=lambda c: (c[1] is None, -(c[1] or 0), c[2], -c[3]))
    return [(full, updates) for full, updates, _, _ in found]


#: the trainer whose checkpoint fairseq is loading, while it does: the files it reads are
#: prepared for that trainer's optimizer (load_checkpoint_to_cpu is also fairseq-generate's)
RESUMING: "contextvars.ContextVar" = contextvars.ContextVar("fairseq_fp16_resuming", default=None)


def _load_checkpoint(self, filename, *args, **kwargs):
    token = RESUMING.set(self)
    try:
        extra_state = _load_checkpoint_or_an_intact_one(self, filename, *args, **kwargs)
    finally:
        RESUMING.reset(token)
    if extra_state is not None:
        check_resumed_batches(self.task, extra_state, filename, self.cfg.checkpoint.reset_dataloader)
    rebuild_ema_model(self, extra_state)
    return extra_state


def _load_checkpoint_or_an_intact_one(self, filename, *args, **kwargs):
    original = _original(TRAINER_LOAD)
    try:
        return original(self, filename, *args, **kwargs)
    except DamagedCheckpointError as err:
        if os.path.basename(str(filename)) != LAST:
            raise
        damaged = err
    for candidate, updates in intact_alternatives(str(filename)):
        try:
            extra_state = original(self, candidate, *args, **kwargs)
        except DamagedCheckpointError:
            continue
        # The damaged bytes are copied aside, not moved: under --load-checkpoint-on-all-dp-ranks
        # every rank reads checkpoint_last.pt, and a rank that found it gone would start afresh.
        # The run's next save replaces it.
        kept = str(filename) + ".damaged"
        tmp = f"{kept}.tmp{os.getpid()}"
        shutil.copyfile(filename, tmp)
        os.replace(tmp, kept)
        logger.warning(
            "fairseq_fp16: %s is truncated or corrupt (%s); resumed from %s (update %s), the intact "
            "checkpoint beside it with the most updates; the damaged file is kept as %s", filename,
            str(damaged).split(" (", 1)[1].split(")", 1)[0], os.path.basename(candidate),
            "?" if updates is None else updates, os.path.basename(kept))
        return extra_state
    raise damaged


TRAINER_LOAD = "fairseq.trainer:Trainer.load_checkpoint"


def _copies_local_files(path_manager) -> Optional[str]:
    """fairseq's PathManager has ``copy(src_path, dst_path, overwrite)``, the call replaced."""
    try:
        params = list(inspect.signature(path_manager.copy).parameters)
    except (AttributeError, TypeError, ValueError):
        return "it has no copy()"
    return None if params[:3] == ["src_path", "dst_path", "overwrite"] else f"copy{tuple(params)}"


PATCHES = [
    Patch(COPY, group="repair", replacement=_AtomicCopyPathManager(), condition=_copies_local_files,
          why="save_checkpoint writes the first file of a save atomically but copies it to "
              "checkpoint_last.pt/checkpoint_best.pt in place, so a kill during the copy leaves "
              "a truncated file; the module's PathManager copies local files through .tmp and a "
              "rename"),
    Patch(SAVE, group="repair", expects=["PathManager.copy(", "trainer.save_checkpoint(checkpoints[0], extra_state)"],
          why="relied on: save_checkpoint copies through the module's PathManager (above)"),
    Patch(TRAINER_LOAD, group="repair", replacement=_load_checkpoint,
          expects=["state = checkpoint_utils.load_checkpoint_to_cpu(",
                   'self.ema.build_fp32_params(extra_state["ema_fp32_params"])'],
          why="a truncated or corrupt checkpoint_last.pt (a kill while stock fairseq copied it) "
              "stops every resume; the run resumes from the intact checkpoint beside it with the "
              "most updates, with a warning naming both files, the damaged one copied to .damaged; "
              "with --ema-fp32 the EMA model is rebuilt from the fp32 EMA loaded (not the writer's "
              "EMA model, rounded again in another dtype); and a stock "
              "fairseq checkpoint's optimizer state (FairseqAdam, FP16Optimizer) is read into the "
              "plugin's optimizer instead of refused as 'Optimizer does not match'"),
    Patch(LOAD, group="repair", replacement=_load_checkpoint_to_cpu,
          expects=['torch.load(f, map_location=torch.device("cpu"))'],
          why="train resume and fairseq-generate load checkpoints here; torch's errors for a "
              "truncated or corrupt file, or a pickled global outside the allow-list of "
              "fairseq checkpoints, become messages naming the file and what to do"),
]
