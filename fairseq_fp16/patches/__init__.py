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
:mod:`.options`, :mod:`.prefetch` and :mod:`.run` (fairseq's trainer, checkpoint files,
distributed start-up, option parsing, batch-prefetch threads and commands), :mod:`.tasks`
(the task base classes: the precision features for every task), :mod:`.incremental_state`
(the decoding-state lookup, for ``--compile-layers``). Outside fairseq, the plugin
adds ``argparse.Namespace`` to torch's weights-only allow-list (:mod:`fairseq_fp16.safe_load`).
"""

from __future__ import annotations

from . import checkpoints, distributed, incremental_state, options, prefetch, run, tasks, trainer
from .registry import GROUPS, REGISTRY, Patch

__all__ = ["GROUPS", "REGISTRY", "Patch", "describe", "install", "is_installed", "uninstall"]

for _module in (trainer, checkpoints, distributed, options, prefetch, run, tasks,
                incremental_state):
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


def describe() -> str:
    """A markdown table of the patches, repairs first."""
    rows = sorted(REGISTRY.table(), key=lambda r: GROUPS.index(r["group"]))
    lines = ["| fairseq | group | kind | why |", "|---|---|---|---|"]
    lines += [f"| `{r['target']}` | {r['group']} | {r['kind']} | {r['why']} |" for r in rows]
    return "\n".join(lines)
