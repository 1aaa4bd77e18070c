"""Parameter names recorded on the parameters themselves (pure torch).

Optimizers receive bare parameters; a name recorded on each lets them group by name
(``--no-decay-params``), lets diagnostics name a parameter, and lets checkpoints match fp32
master weights to parameters.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["CARRIED_ATTRS", "NAME_ATTR", "param_name", "tag_param_names"]

#: Attribute carrying a parameter's qualified name (set by :func:`tag_param_names`).
NAME_ATTR = "_fairseq_fp16_name"
#: Attributes fairseq reads on parameters, carried over to their fp32 masters: the optimizer
#: group (``--optimizer composite``), per-parameter optimizer settings, and the mixture-of-experts
#: marks (expert gradients stay out of the global norm, as in fairseq's clip_grad_norm_).
CARRIED_ATTRS = (NAME_ATTR, "param_group", "optim_overrides", "expert", "base_expert")


def tag_param_names(named_params: Iterable[tuple]) -> None:
    """Record each parameter's qualified name on the parameter itself.

    Optimizers receive bare parameters; the name lets them group by name
    (``--no-decay-params``) and lets diagnostics name a parameter.
    """
    for name, p in named_params:
        if not hasattr(p, NAME_ATTR):
            setattr(p, NAME_ATTR, name)


def param_name(p: torch.Tensor, default: str = "") -> str:
    return getattr(p, NAME_ATTR, default)
