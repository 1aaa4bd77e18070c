"""The optimizer step against the memory-bandwidth limit.

The command line of ``fairseq_fp16_tools.bench.optimizer`` (its docstring has the usage).
"""

import sys

from fairseq_fp16_tools.bench.optimizer import main

if __name__ == "__main__":
    sys.exit(main())
