"""Dropout on the CPU: torch's masks against the plugin's counter-based ones.

The command line of ``fairseq_fp16_tools.bench.dropout`` (its docstring has the usage).
"""

import sys

from fairseq_fp16_tools.bench.dropout import main

if __name__ == "__main__":
    sys.exit(main())
