"""Pool the runs of one or more comparisons and say, per precision, whether it matches fp32.

The command line of ``fairseq_fp16_tools.verdict`` (its docstring has the usage).
"""

import sys

from fairseq_fp16_tools.verdict import main

if __name__ == "__main__":
    sys.exit(main())
