"""Where half precision changes the forward pass: each module's output against fp32's.

:func:`forward_divergence` runs one batch through the half model and through an
fp32 copy of it that holds the fp32 master weights (the values the half weights
round), both in eval mode (no dropout), and returns each module's relative error
``||half - fp32|| / ||fp32||`` on its (first tensor) output. A module's error
includes what its inputs carried in; how it grows from one layer to the next
shows where precision is lost, and which modules ``--fp32-modules`` would help.
``translation_fp16`` takes it every ``--precision-divergence-interval`` updates.
"""

from __future__ import annotations

import copy
from typing import Dict, Mapping, Optional

import torch

__all__ = ["forward_divergence", "summarize_divergence"]

_HALF = (torch.float16, torch.bfloat16)


def _first_tensor(out) -> Optional[torch.Tensor]:
    if torch.is_tensor(out):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            t = _first_tensor(o)
            if t is not None:
                return t
    return None


def _record_outputs(model: torch.nn.Module, store: Dict[str, torch.Tensor]):
    """Forward hooks keeping each named module's first floating-point output of the pass
    (a module called again, as a decoder layer is at each step, keeps its first); a module
    that returns its input (dropout in eval mode) is left out."""
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def hook(_module, args, out, name=name):
            t = _first_tensor(out)
            if (t is not None and t.is_floating_point() and name not in store
                    and not any(t is a for a in args)):
                store[name] = t.detach()

        handles.append(module.register_forward_hook(hook))
    return handles


@torch.no_grad()
def forward_divergence(model: torch.nn.Module, masters: Mapping[int, torch.Tensor],
                       net_input: Mapping) -> Dict[str, float]:
    """Relative error of each module's output in ``model`` (half) against fp32.

    Args:
        model: the half-precision model (left as it was: mode, weights, hooks).
        masters: ``id(parameter) -> fp32 master`` for the model's half parameters; a
            parameter without one (an fp32 island's) is used as it is.
        net_input: the batch's ``net_input`` (``model(**net_input)``).

    Returns:
        ``{module name: ||half - fp32|| / ||fp32||}`` in forward order, for the modules whose
        output has the same shape in both passes and a non-zero fp32 norm; ``inf`` where the
        half output is not finite.
    """
    # A tensor a module keeps from the last graph (weight_norm's weight) cannot be deep-copied;
    # detached, it is the same values, and the module's pre-hook remakes it at the next forward.
    for module in model.modules():
        for key, value in list(vars(module).items()):
            if torch.is_tensor(value) and value.grad_fn is not None:
                setattr(module, key, value.detach())
    ref = copy.deepcopy(model)
    for module in ref.modules():  # the copy keeps no observers of the real model's outputs;
        module._forward_hooks.clear()  # its pre-hooks (weight_norm's, which makes the weight) stay
    for p_ref, p in zip(ref.parameters(), model.parameters()):
        p_ref.data = masters.get(id(p), p).detach().float().clone()
        p_ref.grad = None
    ref.float()
    half_out: Dict[str, torch.Tensor] = {}
    ref_out: Dict[str, torch.Tensor] = {}
    training = model.training
    model.eval()
    ref.eval()
    try:
        ref_input = {k: v.float() if torch.is_tensor(v) and v.dtype in _HALF else v
                     for k, v in net_input.items()}  # token ids pass as they are
        for net, store, inp in ((model, half_out, net_input), (ref, ref_out, ref_input)):
            handles = _record_outputs(net, store)
            try:
                net(**inp)
            finally:
                for h in handles:
                    h.remove()
    finally:
        model.train(training)
    result = {}
    for name, r in ref_out.items():
        h = half_out.get(name)
        if h is None or h.shape != r.shape:
            continue
        r = r.float()
        norm = float(r.norm())
        if norm == 0.0 or not torch.isfinite(r).all():
            continue
        h = h.float()
        result[name] = float((h - r).norm() / norm) if torch.isfinite(h).all() else float("inf")
    return result


def summarize_divergence(errors: Mapping[str, float], top: int = 3) -> str:
    """``"name 2.1e-03, name 1.5e-03, ... (of N modules)"``: the largest relative errors."""
    worst = sorted(errors.items(), key=lambda kv: kv[1], reverse=True)[:top]
    return ", ".join(f"{name} {err:.1e}" for name, err in worst) + f" (of {len(errors)} modules)"
