"""Operators, bytes and host syncs per update of fairseq-train, per precision, on the CPU.

The command line of ``fairseq_fp16_tools.bench.op_census`` (its docstring explains the counts).
"""

import sys

from fairseq_fp16_tools.bench.op_census import main

if __name__ == "__main__":
    sys.exit(main())
