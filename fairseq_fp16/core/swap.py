"""Checked, reversible replacement of one object's attribute (pure Python, no fairseq import).

Besides the changes to fairseq's classes and functions (the registry of
:mod:`fairseq_fp16.patches`), the plugin changes a few single objects: a training set's
batching (``--length-buckets``), a dataset's token count (``--cpu-length-multiple``: the
padded lengths), a dataset's example order while fairseq makes an epoch's batches, a layer's
forward (``--compile-layers``). :func:`swap_attribute` makes each such change
as the registry makes its own: the source of what is replaced must hold the statements the
replacement relies on (:func:`check_source`, which the registry's patches use too), and the
change comes with its undo.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

__all__ = ["check_source", "source_of", "swap_attribute"]

_MISSING = object()


def source_of(obj: Any) -> str:
    """The source of a function, method, class or module (of an instance: its class's)."""
    obj = inspect.unwrap(obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj)
    if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismodule(obj)
            or inspect.ismethod(obj)):
        obj = type(obj)
    return inspect.getsource(obj)


def check_source(what: str, obj: Any, expects: Sequence[str]) -> None:
    """Raise ``RuntimeError`` naming ``what`` and the first of ``expects`` that ``obj``'s
    source lacks (fairseq changed under the plugin)."""
    if not expects:
        return
    source = source_of(obj)
    for needle in expects:
        if needle not in source:
            raise RuntimeError(f"fairseq_fp16: {what} changed ({needle!r} not found); "
                               "this plugin supports fairseq 0.12")


def swap_attribute(obj: Any, name: str, replacement: Any, *, expects: Sequence[str] = ()
                   ) -> Callable[[], None]:
    """Set ``obj.<name>`` to ``replacement`` on this object alone, after checking that the
    attribute its class defines holds each of ``expects`` in its source. Returns the undo, which
    puts back what the object had: its own attribute, or none (its class's again).

    Raises:
        RuntimeError: the class has no such attribute, or its source lacks a statement of
            ``expects`` (naming the class attribute and the statement).
    """
    cls = type(obj)
    what = f"{cls.__module__}:{cls.__qualname__}.{name}"
    if not hasattr(cls, name):
        raise RuntimeError(f"fairseq_fp16: {what} does not exist; this plugin supports fairseq 0.12")
    check_source(what, getattr(cls, name), expects)
    own = vars(obj).get(name, _MISSING)
    setattr(obj, name, replacement)

    def undo() -> None:
        if vars(obj).get(name, _MISSING) is not replacement:
            return  # replaced again since: that change owns it now
        if own is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, own)

    return undo
