"""Patch of ``fairseq.utils.import_user_module``: the run's precision, read where every fairseq
command's ``main`` hands over its ``common`` config."""

from __future__ import annotations

from ..precision import Precision, set_current
from .registry import Patch, original

IMPORT_USER_MODULE = "fairseq.utils:import_user_module"


def _import_user_module(args):
    result = original(IMPORT_USER_MODULE)(args)
    if hasattr(args, "fp16") and hasattr(args, "bf16"):  # a run's common config (or its args)
        set_current(Precision.from_cfg(args))
    return result


PATCHES = [
    Patch(IMPORT_USER_MODULE, group="precision", replacement=_import_user_module,
          expects=['module_path = getattr(args, "user_dir", None)'],
          why="fairseq-train, fairseq-generate and the other commands call it with the run's "
              "common config first thing in main; the plugin reads --fp16/--bf16/--cpu there "
              "(fairseq_fp16.precision.current), so that any task gets the precision features"),
]
