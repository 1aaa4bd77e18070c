"""What a training run used, written for the comparison tools: ``SAVE_DIR/run_info.json``.

The precision features record what they chose as they set up (and the first training step what
it counted); the file is rewritten on each record, and exists from the start of training on
rank 0 of runs that save checkpoints. Keys:

``precision``, ``device`` (``cpu``/``cuda``); ``half_matmul``: the CPU matrix-product path of a
half run (e.g. ``"fp32 accumulation, rounded to half (--half-matmul auto)"``; None for fp32 or
CUDA); ``native_half_products``: half products of the first training step that fp32
accumulation left on native kernels (None: not checked); ``batch_lengths``: e.g. ``"padded to
a multiple of 8 (--cpu-length-multiple auto)"`` (None: as they are); ``kernel_caches``;
``fused_loss``; ``attention``; ``compile_layers``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

__all__ = ["FILENAME", "record", "recorded", "set_path"]

FILENAME = "run_info.json"
_INFO: Dict[str, Any] = {}
_PATH: Optional[str] = None


def record(**entries: Any) -> None:
    """Record ``entries`` (and write the file, once its path is set)."""
    _INFO.update(entries)
    _write()


def recorded() -> Dict[str, Any]:
    return dict(_INFO)


def set_path(path: Optional[str]) -> None:
    """Where the file goes (None: nowhere); writes what was recorded so far."""
    global _PATH
    _PATH = path
    _write()


def _write() -> None:
    if not _PATH:
        return
    os.makedirs(os.path.dirname(os.path.abspath(_PATH)), exist_ok=True)
    tmp = _PATH + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_INFO, f, indent=1, sort_keys=True)
    os.replace(tmp, _PATH)
