"""Patches that give every task the plugin's flags (:mod:`fairseq_fp16.flags`).

* ``register_task``: each registered task dataclass is replaced by itself extended with the
  flags (:func:`~fairseq_fp16.flags.with_precision_flags`), in the three places fairseq keeps
  it: ``TASK_DATACLASS_REGISTRY`` (the command line's config and ``fairseq-hydra-train``'s
  defaults), the task class's ``__dataclass`` (its ``add_args``) and hydra's ConfigStore node
  ``task/<name>`` (the config fairseq composes). Every task registered before the plugin was
  imported is extended at install; one registered later, through the wrapped
  ``register_task``. Uninstalled, each of the three holds fairseq's dataclass again.
* ``FairseqTask.__init__`` / ``LegacyFairseqTask.__init__``: the flags are checked as any task
  is built, before it loads a dataset.

The command line's argument group (which is also how a legacy task, whose config is the whole
``argparse.Namespace``, gets the flags) is added by :mod:`.options`.
"""

from __future__ import annotations

import logging
from typing import Dict, Tuple

from ..flags import PrecisionFlags, validate_precision_flags, with_precision_flags
from .registry import Patch
from .registry import original as _original

logger = logging.getLogger(__name__)

REGISTER = "fairseq.tasks:register_task"
INIT = "fairseq.tasks.fairseq_task:FairseqTask.__init__"
LEGACY_INIT = "fairseq.tasks.fairseq_task:LegacyFairseqTask.__init__"

#: task name -> (fairseq's dataclass, the extended one, hydra's node before, the extended node)
_SWAPPED: Dict[str, Tuple[type, type, object, object]] = {}
_NODES: Dict[Tuple[str, type], object] = {}  # the extended ConfigStore nodes, made once


def _task_repo() -> dict:
    from hydra.core.config_store import ConfigStore

    return ConfigStore.instance().repo.setdefault("task", {})


def _extend(name: str) -> None:
    """Replace task ``name``'s dataclass by the extended one, where fairseq keeps it."""
    from fairseq.tasks import TASK_DATACLASS_REGISTRY, TASK_REGISTRY
    from hydra.core.config_store import ConfigStore

    config = TASK_DATACLASS_REGISTRY.get(name)
    if config is None or name in _SWAPPED:
        return
    extended = with_precision_flags(config)
    if extended is config:  # declares them already
        return
    own = [f for f in PrecisionFlags.__dataclass_fields__ if f != "_name" and f in config.__dataclass_fields__]
    if own:
        logger.warning("fairseq_fp16: task %s declares %s itself; its own declaration is kept", name,
                       ", ".join("--" + f.replace("_", "-") for f in own))
    repo = _task_repo()
    before = repo.get(f"{name}.yaml")
    node = _NODES.get((name, extended))
    if node is None:
        instance = extended()
        instance._name = name
        ConfigStore.instance().store(name=name, group="task", node=instance, provider="fairseq")
        node = _NODES[name, extended] = repo[f"{name}.yaml"]
    repo[f"{name}.yaml"] = node
    TASK_DATACLASS_REGISTRY[name] = extended
    cls = TASK_REGISTRY.get(name)
    if cls is not None and cls.__dict__.get("__dataclass") is config:
        setattr(cls, "__dataclass", extended)
    _SWAPPED[name] = (config, extended, before, node)


def _extend_all() -> None:
    from fairseq.tasks import TASK_DATACLASS_REGISTRY

    for name in list(TASK_DATACLASS_REGISTRY):
        _extend(name)


def _restore_all() -> None:
    """fairseq's dataclasses back, where they still hold the extended ones."""
    from fairseq.tasks import TASK_DATACLASS_REGISTRY, TASK_REGISTRY

    repo = _task_repo()
    for name, (config, extended, before, node) in _SWAPPED.items():
        if TASK_DATACLASS_REGISTRY.get(name) is extended:
            TASK_DATACLASS_REGISTRY[name] = config
        cls = TASK_REGISTRY.get(name)
        if cls is not None and cls.__dict__.get("__dataclass") is extended:
            setattr(cls, "__dataclass", config)
        if repo.get(f"{name}.yaml") is node:
            if before is None:
                del repo[f"{name}.yaml"]
            else:
                repo[f"{name}.yaml"] = before
    _SWAPPED.clear()


def _register_task(name, dataclass=None):
    register = _original(REGISTER)(name, dataclass)

    def register_task_cls(cls):
        from fairseq.tasks import TASK_REGISTRY

        new = name not in TASK_REGISTRY
        registered = register(cls)
        if new and dataclass is not None:
            _extend(name)
        return registered

    return register_task_cls


def _task_init(self, cfg, **kwargs):
    if cfg is not None:  # None: a legacy task, checked by its own __init__
        validate_precision_flags(cfg)
    _original(INIT)(self, cfg, **kwargs)


def _legacy_task_init(self, args):
    if args is not None:
        validate_precision_flags(args)
    _original(LEGACY_INIT)(self, args)


PATCHES = [
    Patch(REGISTER, group="precision", replacement=_register_task,
          on_install=_extend_all, on_uninstall=_restore_all,
          expects=["TASK_DATACLASS_REGISTRY[name] = dataclass", "cls.__dataclass = dataclass",
                   'cs.store(name=name, group="task", node=node, provider="fairseq")'],
          why="every task's dataclass (registered before or after the plugin) gets the plugin's flags "
              "in TASK_DATACLASS_REGISTRY, its class's __dataclass and hydra's task/<name> node, so "
              "--task translation, language_modeling or any other takes them on the command line and "
              "under task: in a hydra config; fairseq's dataclasses are put back on uninstall"),
    Patch(INIT, group="precision", replacement=_task_init, expects=["self.cfg = cfg"],
          why="the plugin's flags are checked as any task is built, before it loads data (a bad "
              "value is refused naming the flag)"),
    Patch(LEGACY_INIT, group="precision", replacement=_legacy_task_init,
          expects=["super().__init__(None)", "self.args = args"],
          why="the same for tasks on the legacy base class, whose flags are in args (cfg is None)"),
]
