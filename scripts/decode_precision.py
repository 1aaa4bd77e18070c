"""Decode a comparison's checkpoints in other precisions: is a BLEU gap made in training or decoding?

The command line of ``fairseq_fp16_tools.decode_precision`` (its docstring has the usage).
"""

import sys

from fairseq_fp16_tools.decode_precision import main

if __name__ == "__main__":
    sys.exit(main())
