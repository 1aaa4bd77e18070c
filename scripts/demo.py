"""make demo: fp32 vs fp16 vs bf16 on a real translation corpus, side by side.

The command line of ``fairseq_fp16_tools.demo`` (its docstring has the usage).
"""

import sys

from fairseq_fp16_tools.demo import main

if __name__ == "__main__":
    sys.exit(main())
