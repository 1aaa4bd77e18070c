"""fairseq_fp16: mixed-precision (fp16/bf16) training for fairseq, as a --user-dir plugin.

Importing the package (``fairseq-train --user-dir fairseq_fp16``) registers
the ``fp16_adam`` optimizer and the ``translation_fp16`` task, installs the
plugin's changes to fairseq (all of them in :mod:`fairseq_fp16.patches`) and
allow-lists the globals of fairseq checkpoints for torch's weights-only
loading (:mod:`fairseq_fp16.safe_load`). The pure-torch pieces live in
:mod:`fairseq_fp16.core` and import no fairseq.
"""

import importlib.util

__version__ = "0.1.0"

# Without fairseq installed, only the pure-torch core (fairseq_fp16.core) is usable.
if importlib.util.find_spec("fairseq") is not None:
    from . import patches, safe_load
    from .optim import fp16_adam  # noqa: F401  (registers fp16_adam)
    from .tasks import translation_fp16  # noqa: F401  (registers translation_fp16)

    safe_load.allow_fairseq_globals()
    patches.install()
