"""fairseq_fp16: mixed-precision (fp16/bf16) training for fairseq, as a --user-dir plugin.

Importing the package (``fairseq-train --user-dir fairseq_fp16``) registers
the ``fp16_adam`` optimizer and the ``translation_fp16`` task, installs the
trainer hook (:mod:`fairseq_fp16.trainer_hook`), has fairseq's batch-prefetch
threads stop before the interpreter exits (:mod:`fairseq_fp16.clean_exit`)
and allow-lists the globals of fairseq checkpoints for torch's weights-only
loading (:mod:`fairseq_fp16.safe_load`). The pure-torch pieces live in
:mod:`fairseq_fp16.core` and import no fairseq.
"""

import importlib.util

__version__ = "0.1.0"

# Without fairseq installed, only the pure-torch core (fairseq_fp16.core) is usable.
if importlib.util.find_spec("fairseq") is not None:
    from . import clean_exit, safe_load, trainer_hook
    from .optim import fp16_adam  # noqa: F401  (registers fp16_adam)
    from .tasks import translation_fp16  # noqa: F401  (registers translation_fp16)

    safe_load.allow_fairseq_globals()
    trainer_hook.install()
    clean_exit.install()
