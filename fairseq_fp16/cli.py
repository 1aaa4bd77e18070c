"""Small command-line helpers."""

import os


def print_user_dir() -> None:
    """Print the path to pass as ``--user-dir`` (works from any directory)::

        fairseq-train ... --user-dir "$(fairseq-fp16-user-dir)"
    """
    print(os.path.dirname(os.path.abspath(__file__)))
