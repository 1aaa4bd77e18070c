"""Optimizer states written by stock fairseq, read into the plugin's optimizer wrapper.

A stock fairseq checkpoint records the optimizer's class name (``FairseqAdam`` for an fp32 run
with ``--optimizer adam``, ``FP16Optimizer`` for ``--fp16``, ``MemoryEfficientFP16Optimizer``),
and fairseq's trainer refuses to load it into another class. :func:`mark_stock_state` (called
on a checkpoint as it is loaded to resume a run with the plugin's optimizer) renames it and
keeps the stock state under ``stock``; :func:`import_stock_state` turns that into the plugin's
layout for the optimizer being resumed:

* the per-parameter moments and step counts, whatever the optimizer's parameter groups now are
  (``FP16Optimizer``'s one flat fp32 parameter is cut back into the parameters, in the order it
  was flattened: the trainer's parameter order, which is also the wrapper's);
* ``FP16Optimizer``/``MemoryEfficientFP16Optimizer``: the loss scale (fairseq saves no other
  scaler state, and neither does it restore one);
* an fp32 checkpoint: its fp32 model weights as the masters of a half run (the half model
  alone would hold them rounded). ``FP16Optimizer`` saves no fp32 masters: a half run rebuilds
  them from the half model, as stock fairseq does on resume.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from ..core.param_names import param_name

__all__ = ["PLUGIN_OPTIMIZER", "STOCK_HALF", "import_stock_state", "mark_stock_state"]

PLUGIN_OPTIMIZER = "MixedPrecisionFairseqOptimizer"
STOCK_HALF = ("FP16Optimizer", "MemoryEfficientFP16Optimizer")


def mark_stock_state(state: Dict) -> Optional[str]:
    """Rename a stock optimizer state so the trainer loads it into the plugin's optimizer.

    Returns the stock optimizer's class name, or None when ``state`` is the plugin's own (or
    holds no optimizer state).
    """
    history = state.get("optimizer_history") or []
    if not history or history[-1].get("optimizer_name") in (None, PLUGIN_OPTIMIZER):
        return None
    if state.get("last_optimizer_state") is None:
        return None
    name = history[-1]["optimizer_name"]
    history[-1]["optimizer_name"] = PLUGIN_OPTIMIZER
    model = state.get("model") or {}
    state["last_optimizer_state"] = {
        "precision": "stock",
        "stock": name,
        "stock_state": state["last_optimizer_state"],
        # an fp32 run's weights are exact: a half run takes them as its masters
        "fp32_weights": {k: v for k, v in model.items()
                         if torch.is_tensor(v) and v.dtype == torch.float32} if name not in STOCK_HALF else {},
    }
    return name


def _per_param(stock: str, saved: Dict, params: Sequence[torch.Tensor]) -> List[Optional[Dict]]:
    """The saved per-parameter states, one per parameter in the trainer's order."""
    order = [i for group in saved["param_groups"] for i in group["params"]]
    states = [saved["state"].get(i) for i in order]
    total = sum(p.numel() for p in params)
    flat = (stock == "FP16Optimizer" and len(order) == 1 and states[0] is not None
            and states[0]["exp_avg"].numel() == total and len(params) > 1)
    if not flat:
        if len(states) != len(params):
            raise ValueError(f"the {stock} state holds {len(states)} parameters, the model {len(params)}: "
                             "was it written by another architecture? (--reset-optimizer starts afresh)")
        return states
    out, offset = [], 0
    for p in params:  # FP16Optimizer flattened them in this order
        n = p.numel()
        out.append({k: (v[offset:offset + n].view(p.shape).clone() if torch.is_tensor(v) and v.numel() == total
                        else v) for k, v in states[0].items()})
        offset += n
    return out


def import_stock_state(stock: str, saved: Dict, target: torch.optim.Optimizer,
                       params: Sequence[torch.Tensor], owners: Sequence[torch.Tensor]) -> Dict:
    """``target``'s state dict holding ``saved``'s per-parameter state.

    ``params`` are ``target``'s parameters in the trainer's order (the masters of a half run),
    ``owners`` the trainer's parameters they stand for (the shapes of the saved state).
    """
    saved = dict(saved)
    saved.pop("loss_scale", None)
    per_param = _per_param(stock, saved, owners)
    position = {id(p): i for i, p in enumerate(params)}
    layout = target.state_dict()
    state, index = {}, 0
    for group in target.param_groups:
        for p in group["params"]:
            s = per_param[position[id(p)]]
            if s is not None:
                if tuple(s["exp_avg"].shape) != tuple(p.shape):
                    raise ValueError(f"the {stock} state of {param_name(p) or 'a parameter'} has shape "
                                     f"{tuple(s['exp_avg'].shape)}, the model's {tuple(p.shape)}")
                state[index] = {k: (v.to(p.device, torch.float32) if torch.is_tensor(v) and v.dim() else v)
                                for k, v in s.items()}
            index += 1
    return {"state": state, "param_groups": layout["param_groups"]}


def stock_loss_scale(saved: Dict) -> Optional[float]:
    """The loss scale a stock half-precision state saved (None: none)."""
    scale = saved.get("loss_scale")
    return None if scale is None else float(scale)
