"""Average the weights of a run's last checkpoints into one checkpoint to decode.

The command line of ``fairseq_fp16_tools.checkpoints`` (its ``AVERAGE_DOC`` has the usage).
"""

import sys

from fairseq_fp16_tools.checkpoints import average_main as main

if __name__ == "__main__":
    sys.exit(main())
