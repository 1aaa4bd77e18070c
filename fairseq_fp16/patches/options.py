"""Patch of fairseq's option parsing: ``--fp16 --bf16`` refused naming both flags."""

from __future__ import annotations

import sys

from ..precision import EXCLUSIVE
from .registry import Patch
from .registry import original as _original

PARSE = "fairseq.options:parse_args_and_arch"



EXCLUSIVE_FLAGS = ("--fp16", "--bf16")


def _parse_args_and_arch(parser, input_args=None, *args, **kwargs):
    argv = sys.argv[1:] if input_args is None else list(input_args)
    if all(flag in argv for flag in EXCLUSIVE_FLAGS):
        parser.error(f"{EXCLUSIVE} (fairseq_fp16)")
    return _original(PARSE)(parser, input_args, *args, **kwargs)


PATCHES = [
    Patch(PARSE, group="repair", replacement=_parse_args_and_arch,
          expects=["if args.bf16:", "args.tpu = True",
                   'raise ValueError("Cannot combine --fp16 and --tpu, use --bf16 on TPUs")'],
          why="fairseq turns --bf16 into --tpu before it sees --fp16, and then complains about "
              "--tpu; --fp16 --bf16 is refused by argparse naming both flags"),
]
