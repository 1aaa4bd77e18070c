"""Every change the plugin makes to fairseq, in one registry.

A fairseq plugin normally only registers components. This one also has to change fairseq 0.12
in a few places: some are repairs (fairseq 0.12 fails or misbehaves with today's torch, Python
or off CUDA), the others give the precision features a way in. Each change is a
:class:`~fairseq_fp16.patches.registry.Patch` in :data:`REGISTRY`, with what it replaces (or,
for an internal the plugin relies on without replacing it, what it uses), why, and the
statements of fairseq's source it depends on. :func:`install` (run when the plugin is
imported) checks every patch against the installed fairseq and then installs them all, or
none: a fairseq whose source differs is refused with the patch and statement named.
:func:`uninstall` restores fairseq. :func:`describe` lists them::

    python -c "import fairseq_fp16.patches as p; print(p.describe())"

Modules, by what they patch: :mod:`.trainer`, :mod:`.checkpoints`, :mod:`.distributed`,
:mod:`.options` and :mod:`.prefetch` (fairseq's trainer, checkpoint files, distributed
start-up, option parsing and batch-prefetch threads), :mod:`.tasks`
(the task base classes, which call the precision features of :mod:`fairseq_fp16.features` for every task), :mod:`.flags` (the task
registry and constructors: the plugin's flags for every task), :mod:`.incremental_state`
(the decoding-state lookup, for ``--compile-layers``), :mod:`.dropout` (``FairseqDropout``'s
masks on the CPU, ``--cpu-dropout``), :mod:`.data` (a data-bin's splits checked as they load).
Outside fairseq, the plugin
adds ``argparse.Namespace`` to torch's weights-only allow-list (:mod:`fairseq_fp16.safe_load`).
"""

from __future__ import annotations

import os

import torch

from . import (checkpoints, data, distributed, dropout, flags, incremental_state, options, prefetch,
               tasks, trainer)
from .registry import GROUPS, REGISTRY, Patch

__all__ = ["GROUPS", "PROCESS_SETTINGS", "REGISTRY", "Patch", "describe", "install", "is_installed",
           "uninstall"]

for _module in (trainer, checkpoints, distributed, options, prefetch, tasks, flags,
                incremental_state, dropout, data):
    for _patch in _module.PATCHES:
        REGISTRY.add(_patch)


def install() -> None:
    """Check every patch against the installed fairseq, then install all (idempotent)."""
    REGISTRY.install()


def uninstall() -> None:
    """Restore everything :func:`install` replaced."""
    REGISTRY.uninstall()


def is_installed() -> bool:
    return REGISTRY.installed


def _safe_globals() -> str:
    from ..safe_load import FAIRSEQ_CHECKPOINT_GLOBALS

    allowed = set(torch.serialization.get_safe_globals())
    return ", ".join(f"{c.__module__}.{c.__qualname__}" for c in FAIRSEQ_CHECKPOINT_GLOBALS if c in allowed) or "none"


def _cudnn_attention() -> str:
    enabled = getattr(torch.backends.cuda, "cudnn_sdp_enabled", None)
    return "n/a" if enabled is None else ("on" if enabled() else "off")


def _recompile_limit() -> str:
    import torch._dynamo

    return str(torch._dynamo.config.recompile_limit)


def _kernel_caches() -> str:
    from ..core.cpu_kernel_cache import CACHE_ENV_VARS

    return ", ".join(f"{v}={os.environ[v]}" for v in CACHE_ENV_VARS if v in os.environ) or "unset"


#: What the plugin changes in the process beyond fairseq's names: (what, when, why, its value now).
PROCESS_SETTINGS = [
    ("torch's weights-only allow-list", "on import",
     "fairseq checkpoints pickle an argparse.Namespace; torch >= 2.6 loads weights-only", _safe_globals),
    ("cuDNN scaled-dot-product attention", "half runs on CUDA (--attention-path torch)",
     "off: cuDNN builds a plan for every new batch shape", _cudnn_attention),
    ("torch._dynamo.config.recompile_limit", "--compile-layers",
     "raised to 32: a decoder layer has up to 8 graph variants", _recompile_limit),
    ("oneDNN kernel-cache capacities (environment)", "CPU half runs (--cpu-kernel-cache)",
     "bounded where the user set none: one kernel per product shape", _kernel_caches),
    ("each compiled layer's forward (per instance)", "--compile-layers",
     "the module's forward runs its compiled graph in training", lambda: "per module"),
]


def describe() -> str:
    """Markdown tables of the patches, repairs first, and of the process-wide settings the
    plugin makes, with their values now."""
    rows = sorted(REGISTRY.table(), key=lambda r: GROUPS.index(r["group"]))
    lines = ["| fairseq | group | kind | why |", "|---|---|---|---|"]
    lines += [f"| `{r['target']}` | {r['group']} | {r['kind']} | {r['why']} |" for r in rows]
    lines += ["", "| process-wide setting | made | why | now |", "|---|---|---|---|"]
    lines += [f"| {what} | {when} | {why} | {read()} |" for what, when, why, read in PROCESS_SETTINGS]
    return "\n".join(lines)
