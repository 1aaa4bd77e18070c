"""Where the repository's parts are: the scripts the tools run as subprocesses and the plugin's
``--user-dir``."""

from pathlib import Path

#: the repository root (this package sits at its top)
ROOT = Path(__file__).resolve().parents[1]
#: the plugin, as fairseq's --user-dir
USER_DIR = str(ROOT / "fairseq_fp16")
SCRIPTS = ROOT / "scripts"


def script(name: str) -> str:
    """The path of ``scripts/NAME``, to run in a subprocess."""
    return str(SCRIPTS / name)
