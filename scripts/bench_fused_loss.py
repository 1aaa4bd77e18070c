"""The fused loss's paths against fairseq's loss, forward and backward from half logits.

The command line of ``fairseq_fp16_tools.bench.fused_loss`` (its docstring has the usage).
"""

import sys

from fairseq_fp16_tools.bench.fused_loss import main

if __name__ == "__main__":
    sys.exit(main())
