"""Batch shapes and padding of a data-bin's training batches, as fairseq makes them and bucketed.

The command line of ``fairseq_fp16_tools.bucket_stats`` (its docstring has the usage).
"""

import sys

from fairseq_fp16_tools.bucket_stats import main

if __name__ == "__main__":
    sys.exit(main())
