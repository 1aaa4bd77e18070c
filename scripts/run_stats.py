"""Run a fairseq CLI in this process and record its wall time and peak memory.

The command line of ``fairseq_fp16_tools.bench.run_stats`` (its docstring has the usage).
"""

import sys

# fairseq_fp16_tools.bench.run_stats imports nothing of fairseq or the plugin before fairseq's CLI
# module, so that the CLI sets up logging first: keep this file free of other imports.

from fairseq_fp16_tools.bench.run_stats import main

if __name__ == "__main__":
    sys.exit(main())
