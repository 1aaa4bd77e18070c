"""Train the same model in fp32 and in mixed precision, side by side, and score each.

The command line of ``fairseq_fp16_tools.compare`` (its docstring has the usage).
"""

import sys

from fairseq_fp16_tools.compare import main

if __name__ == "__main__":
    sys.exit(main())
