"""Where an update's time goes: a torch.profiler trace of a few updates, summarised.

The command line of ``fairseq_fp16_tools.bench.profile_summary`` (its docstring has the usage).
"""

import sys

from fairseq_fp16_tools.bench.profile_summary import main

if __name__ == "__main__":
    sys.exit(main())
