"""Time per update of real fairseq-train runs, per precision, on the same model and data.

The command line of ``fairseq_fp16_tools.bench.fairseq_train`` (its docstring has the usage).
"""

import sys

from fairseq_fp16_tools.bench.fairseq_train import main

if __name__ == "__main__":
    sys.exit(main())
