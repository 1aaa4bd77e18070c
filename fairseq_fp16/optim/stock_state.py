"""Saved optimizer states made ready for the plugin's optimizer wrapper as a run resumes.

:func:`prepare_for_resume` is called on a checkpoint as it is loaded to resume a run with the
plugin's optimizer. It records the ``--optimizer`` the checkpoint was written with (from its
config), so that the wrapper can refuse another one with fairseq's own advice
(``--reset-optimizer``), and it gives the wrapper what a half-precision resume needs that the
optimizer state lacks: an fp32 checkpoint's fp32 model weights, the exact masters (the half
model alone holds them rounded).

A stock fairseq checkpoint records the optimizer's class name (``FairseqAdam`` for an fp32 run
with ``--optimizer adam``, ``FairseqNAG``, ``FP16Optimizer`` for ``--fp16``,
``MemoryEfficientFP16Optimizer``), and fairseq's trainer refuses to load it into another class.
:func:`prepare_for_resume` renames it and keeps the stock state under ``stock``;
:func:`import_stock_state` turns that into the plugin's layout for the optimizer being resumed:

* the per-parameter state of any fairseq optimizer (Adam's moments, a momentum buffer,
  Adagrad's sums, Adafactor's factored moments), with the step counts, whatever the optimizer's
  parameter groups now are. ``FP16Optimizer``'s one flat fp32 parameter is cut back into the
  parameters, in the order it was flattened: the trainer's parameter order, which is also the
  wrapper's. apex's ``FusedAdam`` (fairseq's ``adam`` on a GPU with apex) keeps the step count in
  the parameter group, not per parameter: it is given to each parameter;
* ``FP16Optimizer``/``MemoryEfficientFP16Optimizer``: the loss scale (fairseq saves no other
  scaler state, and neither does it restore one). ``FP16Optimizer`` saves no fp32 masters: a
  half run takes the saved half weights, widened, as stock fairseq does on resume (a model of
  the other half dtype would hold them rounded).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from ..core.adam import BACKEND_KEYS
from ..core.param_names import param_name

__all__ = ["PLUGIN_OPTIMIZER", "PLUGIN_TAG", "SAVED_NAME", "STOCK_HALF", "check_same_optimizer",
           "describe_state", "history_names",
           "import_stock_state", "prepare_for_resume", "saved_optimizer_name", "stock_loss_scale"]

PLUGIN_OPTIMIZER = "MixedPrecisionFairseqOptimizer"
#: what a checkpoint's optimizer history says of a run of the plugin's wrapper:
#: ``<the --optimizer's class> (fairseq_fp16 <precision>)``, e.g. ``FP16Adam (fairseq_fp16 bf16)``
#: (checkpoints written before it say PLUGIN_OPTIMIZER)
PLUGIN_TAG = " (fairseq_fp16 "
#: where a loaded history entry keeps its saved name while it reads PLUGIN_OPTIMIZER
SAVED_NAME = "fairseq_fp16_saved_name"
STOCK_HALF = ("FP16Optimizer", "MemoryEfficientFP16Optimizer")
#: --optimizer values of stock checkpoints whose state another --optimizer takes parameter by
#: parameter (the same moments; the plugin's fp16_adam splits the parameters into groups)
STOCK_INTERCHANGEABLE = {"adam": {"adam", "fp16_adam"}}
#: per-parameter state entries that have the parameter's shape
SHAPED_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer", "sum")


def saved_optimizer_name(state: Dict) -> Optional[str]:
    """The ``--optimizer`` of the run that wrote checkpoint ``state`` (None: not recorded)."""
    cfg = state.get("cfg")
    try:
        name = cfg["optimizer"]["_name"] if cfg is not None else getattr(state.get("args"), "optimizer", None)
    except (KeyError, TypeError):
        name = None
    return None if name is None else str(name)


def _fp32_weights(state: Dict) -> Dict[str, torch.Tensor]:
    """The checkpoint's model weights as fp32: exact for an fp32 run; a half run's are the half
    values widened, which a model of the other half dtype would round."""
    model = state.get("model") or {}
    return {k: v.float() for k, v in model.items() if torch.is_tensor(v) and v.is_floating_point()}


def prepare_for_resume(state: Dict) -> Optional[str]:
    """Make checkpoint ``state``'s optimizer state loadable by the plugin's optimizer wrapper
    (in place); see the module's docstring.

    Returns the stock optimizer's class name for a stock fairseq state, else None.
    """
    history = state.get("optimizer_history") or []
    saved = state.get("last_optimizer_state")
    if not history or not isinstance(saved, dict):
        return None
    name = history[-1].get("optimizer_name")
    if name is None:
        return None
    # fairseq's trainer compares the last entry's name with the wrapper's class name; the name
    # saved (what a reader of the history sees) goes back in as the run saves its next checkpoint
    history[-1] = dict(history[-1], optimizer_name=PLUGIN_OPTIMIZER, **{SAVED_NAME: name})
    if name == PLUGIN_OPTIMIZER or PLUGIN_TAG in name:
        saved.setdefault("optimizer_name", saved_optimizer_name(state))
        if saved.get("precision") == "fp32":  # exact weights for the masters of a half run
            saved["fp32_weights"] = _fp32_weights(state)
        return None
    state["last_optimizer_state"] = {
        "precision": "stock",
        "stock": name,
        "stock_optimizer": saved_optimizer_name(state),
        "stock_state": saved,
        # a half run's masters: an fp32 run's weights (exact), or FP16Optimizer's half weights
        # (it saves no masters), also where this run's model has the other half dtype
        "fp32_weights": _fp32_weights(state),
    }
    return name


def history_names(history: List[Dict], current: Optional[str]) -> List[Dict]:
    """A copy of the optimizer ``history`` fairseq saves, each entry named as it was saved and the
    last (this run's) ``current`` where given."""
    named = []
    for entry in history:
        entry = dict(entry)
        saved = entry.pop(SAVED_NAME, None)
        if saved is not None:
            entry["optimizer_name"] = saved
        named.append(entry)
    if current is not None and named:
        named[-1]["optimizer_name"] = current
    return named


def check_same_optimizer(saved: Optional[str], current: Optional[str], stock: bool) -> None:
    """Refuse a state written with another ``--optimizer``, as fairseq's trainer does.

    Raises:
        ValueError: naming both optimizers and ``--reset-optimizer``.
    """
    if saved is None or current is None or saved == current:
        return
    if stock and current in STOCK_INTERCHANGEABLE.get(saved, ()):
        return
    raise ValueError(
        f"Optimizer does not match; please reset the optimizer (--reset-optimizer). The checkpoint "
        f"was written with --optimizer {saved}, this run has --optimizer {current} (fairseq_fp16)")


def _per_param(stock: str, saved: Dict, params: Sequence[torch.Tensor]) -> List[Optional[Dict]]:
    """The saved per-parameter states, one per parameter in the trainer's order, each with its
    step count (a group's, where the optimizer keeps it there)."""
    order = [i for group in saved["param_groups"] for i in group["params"]]
    group_step = {i: group["step"] for group in saved["param_groups"] if "step" in group
                  for i in group["params"]}
    states = [saved["state"].get(i) for i in order]
    states = [dict(s, step=group_step[i]) if s and "step" not in s and i in group_step else s
              for i, s in zip(order, states)]
    if all(s is None for s in states):
        return [None] * len(params)  # no state yet (e.g. SGD without momentum)
    total = sum(p.numel() for p in params)
    flat = (stock in STOCK_HALF and len(order) == 1 and len(params) > 1 and states[0] is not None
            and any(torch.is_tensor(v) and v.dim() and v.numel() == total for v in states[0].values()))
    if not flat:
        if len(states) != len(params):
            raise ValueError(f"the {stock} state holds {len(states)} parameters, the model {len(params)}: "
                             "was it written by another architecture? (--reset-optimizer starts afresh)")
        return states
    out, offset = [], 0
    for p in params:  # FP16Optimizer flattened them in this order
        n = p.numel()
        out.append({k: (v[offset:offset + n].view(p.shape).clone()
                        if torch.is_tensor(v) and v.dim() and v.numel() == total else v)
                    for k, v in states[0].items()})
        offset += n
    return out


def _tensor_steps(target: torch.optim.Optimizer) -> bool:
    """Whether ``target`` keeps its step counts as tensors (torch's Adam family does)."""
    return isinstance(target, (torch.optim.Adam, torch.optim.AdamW))


def _value(key: str, value: Any, p: torch.Tensor, target: torch.optim.Optimizer) -> Any:
    if key == "step" and _tensor_steps(target):
        return torch.tensor(float(value), dtype=torch.float32)
    if torch.is_tensor(value) and value.dim():
        return value.to(p.device, torch.float32)
    return value


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
    if len(saved["param_groups"]) == len(layout["param_groups"]):
        # what the optimizer keeps in its groups (NAG's last learning rate, the
        # hyperparameters a stock resume restores), as fairseq's own resume loads them
        for mine, theirs in zip(layout["param_groups"], saved["param_groups"]):
            mine.update({k: v for k, v in theirs.items()
                         if k not in ("params", *BACKEND_KEYS) and (k != "step" or "step" in mine)})
    state, index = {}, 0
    for group, layout_group in zip(target.param_groups, layout["param_groups"]):
        steps = []
        for p in group["params"]:
            s = per_param[position[id(p)]]
            if s is not None:
                for key in SHAPED_KEYS:
                    if key in s and tuple(s[key].shape) != tuple(p.shape):
                        raise ValueError(f"the {stock} state of {param_name(p) or 'a parameter'} has shape "
                                         f"{tuple(s[key].shape)}, the model's {tuple(p.shape)}")
                state[index] = {k: _value(k, v, p, target) for k, v in s.items()}
                if "step" in s:
                    steps.append(float(s["step"]))
            index += 1
        if "step" in layout_group and steps:  # a target that counts steps per group (apex)
            layout_group["step"] = type(layout_group["step"])(max(steps))
    return {"state": state, "param_groups": layout["param_groups"]}


def describe_state(torch_state: Dict) -> str:
    """What a converted state carries, for the log: ``Adam moments and steps``, or the keys."""
    keys = sorted({k for s in torch_state["state"].values() for k in s})
    if set(keys) <= {"exp_avg", "exp_avg_sq", "step"} and keys:
        return "Adam moments and steps"
    return f"optimizer state ({', '.join(keys)})" if keys else "an empty optimizer state"


def stock_loss_scale(saved: Dict) -> Optional[float]:
    """The loss scale a stock half-precision state saved (None: none)."""
    scale = saved.get("loss_scale")
    return None if scale is None else float(scale)
