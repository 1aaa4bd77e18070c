"""Write a small synthetic parallel corpus and binarise it with fairseq-preprocess.

The command line of ``fairseq_fp16_tools.corpus`` (its docstring has the usage).
"""

import sys

from fairseq_fp16_tools.corpus import main

if __name__ == "__main__":
    sys.exit(main())
