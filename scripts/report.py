"""Read the results of scripts/compare.py and write report.md and PNG plots.

The command line of ``fairseq_fp16_tools.report`` (its docstring has the usage).
"""

import sys

from fairseq_fp16_tools.report import main

if __name__ == "__main__":
    sys.exit(main())
