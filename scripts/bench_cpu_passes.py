"""The passes of a bf16 CPU update around its matrix products, against the memory's speed and torch's alternatives.

The command line of ``fairseq_fp16_tools.bench.cpu_passes`` (its docstring has the usage).
"""

import sys

from fairseq_fp16_tools.bench.cpu_passes import main

if __name__ == "__main__":
    sys.exit(main())
