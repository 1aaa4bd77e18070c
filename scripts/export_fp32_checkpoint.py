"""Write a copy of a mixed-precision checkpoint whose model weights are the exact fp32 masters.

The command line of ``fairseq_fp16_tools.checkpoints`` (its ``EXPORT_DOC`` has the usage).
"""

import sys

from fairseq_fp16_tools.checkpoints import export_main as main

if __name__ == "__main__":
    sys.exit(main())
