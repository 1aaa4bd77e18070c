"""Draw a mixed-precision run's traces (PNG).

The command line of ``fairseq_fp16_tools.plot_trace`` (its docstring has the usage).
"""

import sys

from fairseq_fp16_tools.plot_trace import main

if __name__ == "__main__":
    sys.exit(main())
