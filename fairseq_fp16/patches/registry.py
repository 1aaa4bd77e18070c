"""The registry behind :mod:`fairseq_fp16.patches`: what a patch is, how it is checked,
installed and uninstalled. A change to one object rather than to fairseq's classes goes through
:func:`fairseq_fp16.core.swap.swap_attribute`, with the same source check."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..core.swap import check_source

__all__ = ["GROUPS", "REGISTRY", "Patch", "Registry", "original"]

#: repair: fairseq 0.12 failing or misbehaving on today's torch, Python or a CPU;
#: precision: what the plugin's features (mixed precision and its speed) need from fairseq.
GROUPS = ("repair", "precision")
_MISSING = object()


@dataclass
class Patch:
    """One change to fairseq.

    Args:
        target: ``"module:Attr"`` or ``"module:Class.attr"``: what is replaced, or, with
            ``replacement`` None, what the plugin relies on without replacing it (an internal
            it calls or an attribute it sets on fairseq's objects).
        why: one sentence: what fairseq does and what the replacement does instead.
        group: one of :data:`GROUPS`.
        replacement: the new attribute value (None: nothing is replaced).
        expects: statements that must appear in the original's source (or, for a class or a
            module, in its source); a fairseq whose source lacks one is refused at install.
        condition: for what source text cannot say (a signature): called with the original,
            returns None when it is as expected, else what differs.
        on_install / on_uninstall: extra work done with the replacement (an ``atexit`` handler).
    """

    target: str
    why: str
    group: str
    replacement: Any = None
    expects: Sequence[str] = ()
    condition: Optional[Callable[[Any], Optional[str]]] = None
    on_install: Optional[Callable[[], None]] = None
    on_uninstall: Optional[Callable[[], None]] = None
    original: Any = field(default=_MISSING, repr=False)

    def __post_init__(self):
        if self.group not in GROUPS:
            raise ValueError(f"patch {self.target}: group must be one of {GROUPS}, got {self.group!r}")
        if ":" not in self.target:
            raise ValueError(f"patch target must be 'module:Attr', got {self.target!r}")

    def owner_and_name(self) -> Tuple[Any, str]:
        module_name, path = self.target.split(":")
        owner: Any = importlib.import_module(module_name)
        *parents, name = path.split(".")
        for part in parents:
            owner = getattr(owner, part)
        return owner, name

    def current(self) -> Any:
        owner, name = self.owner_and_name()
        if not hasattr(owner, name):
            raise RuntimeError(f"fairseq_fp16: {self.target} does not exist; this plugin supports fairseq 0.12")
        return owner.__dict__[name] if isinstance(owner, type) and name in owner.__dict__ \
            else getattr(owner, name)

    @property
    def installed(self) -> bool:
        return self.original is not _MISSING

    def check(self) -> None:
        """Raise ``RuntimeError`` naming the target and the statement fairseq no longer has."""
        obj = self.original if self.installed else self.current()
        if self.condition is not None:
            differs = self.condition(obj)
            if differs:
                raise RuntimeError(f"fairseq_fp16: {self.target} changed ({differs}); "
                                   "this plugin supports fairseq 0.12")
        check_source(self.target, obj, self.expects)

    def install(self) -> None:
        if self.installed or self.replacement is None:
            if self.replacement is None and not self.installed:
                self.original = self.current()
            return
        owner, name = self.owner_and_name()
        self.original = self.current()
        setattr(owner, name, self.replacement)
        if self.on_install:
            self.on_install()

    def uninstall(self) -> None:
        if not self.installed:
            return
        if self.replacement is not None:
            owner, name = self.owner_and_name()
            setattr(owner, name, self.original)
            if self.on_uninstall:
                self.on_uninstall()
        self.original = _MISSING


class Registry:
    """Patches installed and uninstalled together, each target once."""

    def __init__(self) -> None:
        self.patches: List[Patch] = []

    def add(self, patch: Patch) -> Patch:
        if any(p.target == patch.target for p in self.patches):
            raise ValueError(f"{patch.target} is patched twice")
        self.patches.append(patch)
        return patch

    def get(self, target: str) -> Patch:
        for p in self.patches:
            if p.target == target:
                return p
        raise KeyError(target)

    def original(self, target: str) -> Any:
        """What ``target`` was before :meth:`install` (the replacements call it)."""
        p = self.get(target)
        return p.original if p.installed else p.current()

    @property
    def installed(self) -> bool:
        return bool(self.patches) and all(p.installed for p in self.patches)

    def check(self) -> None:
        for p in self.patches:
            p.check()

    def install(self) -> None:
        """Check every patch against the installed fairseq, then install them all (idempotent).

        Raises:
            RuntimeError: before anything is installed, when fairseq is not what a patch expects.
        """
        if self.installed:
            return
        self.check()
        for p in self.patches:
            p.install()

    def uninstall(self) -> None:
        for p in reversed(self.patches):
            p.uninstall()

    def table(self) -> List[Dict[str, str]]:
        """``target``, ``group``, ``kind`` (replaced / relied on) and ``why`` of each patch."""
        return [{"target": p.target, "group": p.group,
                 "kind": "replaced" if p.replacement is not None else "relied on", "why": p.why}
                for p in self.patches]


#: The plugin's patches (filled by :mod:`fairseq_fp16.patches`).
REGISTRY = Registry()


def original(target: str) -> Any:
    """What ``target`` was before the plugin's patches (the replacements call it)."""
    return REGISTRY.original(target)
