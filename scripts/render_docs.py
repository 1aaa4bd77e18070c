"""Render the docs' results tables from the committed JSON files.

The command line of ``fairseq_fp16_tools.render_docs`` (its docstring has the usage).
"""

import sys

from fairseq_fp16_tools.render_docs import main

if __name__ == "__main__":
    sys.exit(main())
