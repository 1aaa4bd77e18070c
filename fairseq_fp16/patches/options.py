"""Patch of fairseq's option parsing: the plugin's flags as an argument group of every command's
parser (every task: :mod:`fairseq_fp16.flags`), and an fp16 flag with a bf16 one (``--fp16
--bf16``, or either's ``--memory-efficient-`` form) refused naming both flags."""

from __future__ import annotations

import sys

from ..flags import add_precision_group
from ..precision import exclusive
from .registry import Patch
from .registry import original as _original

PARSE = "fairseq.options:parse_args_and_arch"
#: each half precision's flags (fairseq turns a memory-efficient flag into its precision's)
HALF_FLAGS = (("--fp16", "--memory-efficient-fp16"), ("--bf16", "--memory-efficient-bf16"))


def _parse_args_and_arch(parser, input_args=None, *args, **kwargs):
    argv = sys.argv[1:] if input_args is None else list(input_args)
    fp16, bf16 = ([f for f in flags if f in argv] for flags in HALF_FLAGS)
    if fp16 and bf16:
        parser.error(f"{exclusive(fp16[0], bf16[0])} (fairseq_fp16)")
    add_precision_group(parser)  # before fairseq's first parse, which answers --help
    return _original(PARSE)(parser, input_args, *args, **kwargs)


PATCHES = [
    Patch(PARSE, group="repair", replacement=_parse_args_and_arch,
          expects=["if args.bf16:", "args.tpu = True",
                   'raise ValueError("Cannot combine --fp16 and --tpu, use --bf16 on TPUs")',
                   "args, _ = parser.parse_known_args(input_args)",
                   "TASK_REGISTRY[args.task].add_args(parser)"],
          why="fairseq turns --bf16 into --tpu before it sees --fp16, and then complains about "
              "--tpu (--memory-efficient-bf16 into --bf16 first); an fp16 flag with a bf16 one is "
              "refused by argparse naming both flags. The plugin's flags "
              "are added as a group of their own whatever the task (a legacy task's config is the "
              "parsed Namespace; fairseq then skips a dataclass task's fields of the same names), "
              "before the first parse, which is the one that answers --help"),
]
