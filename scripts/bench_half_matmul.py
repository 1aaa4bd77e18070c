"""ms per training step of one transformer in fp32, native fp16/bf16 and fp32-accumulate fp16/bf16.

The command line of ``fairseq_fp16_tools.bench.half_matmul`` (its docstring has the usage).
"""

import sys

from fairseq_fp16_tools.bench.half_matmul import main

if __name__ == "__main__":
    sys.exit(main())
