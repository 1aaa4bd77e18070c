"""Where half precision changes the forward pass: each module's output against fp32's.

:func:`forward_divergence` runs one batch through the half model and through the
same model turned fp32 in place for one pass, holding the fp32 master weights
(the values the half weights round), both in eval mode (no dropout), and returns
each module's relative error ``||half - fp32|| / ||fp32||`` on its (first
tensor) output. A module's error includes what its inputs carried in; how it
grows from one layer to the next shows where precision is lost, and which
modules ``--fp32-modules`` would help.
``translation_fp16`` takes it every ``--precision-divergence-interval`` updates.
"""

from __future__ import annotations

import contextlib
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


def _outputs(model: torch.nn.Module, net_input: Mapping) -> Dict[str, torch.Tensor]:
    """Each named module's first output of one pass of ``model(**net_input)``."""
    store: Dict[str, torch.Tensor] = {}
    handles = _record_outputs(model, store)
    try:
        model(**net_input)
    finally:
        for h in handles:
            h.remove()
    return store


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside torch's and fairseq's data-parallel wrappers (``DataParallel``,
    ``DistributedDataParallel`` and its subclasses, fairseq's legacy one and its
    ``ModuleProxyWrapper``): its forward, called on one rank alone, issues no collective."""
    def is_wrapper(m):
        return (isinstance(m, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel))
                or type(m).__name__ in ("LegacyDistributedDataParallel", "ModuleProxyWrapper")
                ) and isinstance(getattr(m, "module", None), torch.nn.Module)

    while is_wrapper(model):
        model = model.module
    return model


@contextlib.contextmanager
def _as_fp32(model: torch.nn.Module, masters: Mapping[int, torch.Tensor]):
    """Within the block, ``model`` is its fp32 twin, in place: each module's half parameters
    are replaced by their fp32 masters (the same storage, read only; the parameter objects
    are not touched), half buffers are upcast, fp32 islands return fp32, forward hooks are
    off (the twin's pass is no one's business); forward pre-hooks stay (weight_norm's makes
    the weight from g and v). On exit every parameter, buffer, hook, island and plain
    tensor attribute (caches a forward sets, weight_norm's weight) is what it was."""
    params, buffers, hooks, attrs, islands = [], [], [], [], []
    try:
        for module in model.modules():
            attrs.append((module, {k: v for k, v in vars(module).items() if torch.is_tensor(v)}))
            if getattr(module, "_island_model_dtype", None) is not None:
                # an fp32 island returns the model's dtype when no input is half: fp32 here
                islands.append((module, module._island_model_dtype))
                module._island_model_dtype = None
            for name in ("_forward_hooks", "_forward_hooks_with_kwargs"):
                if getattr(module, name, None):
                    hooks.append((module, name, getattr(module, name)))
                    setattr(module, name, type(getattr(module, name))())
            for name, buf in module._buffers.items():
                if buf is not None and buf.dtype in _HALF:
                    buffers.append((module, name, buf))
                    module._buffers[name] = buf.float()
            # the module's entry, not the parameter, changes: a parameter's .data set to another
            # dtype would drop its gradient accumulator, and with it the hooks DDP's reducer put
            # there (that rank's gradients would skip the all-reduce)
            for name, p in module._parameters.items():
                if p is not None and p.dtype in _HALF:
                    params.append((module, name, p))
                    module._parameters[name] = masters.get(id(p), p).detach().float()
        yield model
    finally:
        for module, name, p in params:
            module._parameters[name] = p
        for module, name, buf in buffers:
            module._buffers[name] = buf
        for module, name, table in hooks:
            setattr(module, name, table)
        for module, dtype in islands:
            module._island_model_dtype = dtype
        for module, saved in attrs:
            for key in [k for k, v in vars(module).items() if torch.is_tensor(v) and k not in saved]:
                delattr(module, key)
            for key, value in saved.items():
                setattr(module, key, value)


@torch.no_grad()
def forward_divergence(model: torch.nn.Module, masters: Mapping[int, torch.Tensor],
                       net_input: Mapping) -> Dict[str, float]:
    """Relative error of each module's output in ``model`` (half) against fp32.

    The fp32 pass runs on the model itself, its modules holding the masters in place of their
    half parameters for the pass (no copy of the model is made); afterwards the model is as
    it was.

    Args:
        model: the half-precision model (left as it was: mode, weights, hooks), or a
            data-parallel wrapper of it (the wrapped model runs, on this rank alone).
        masters: ``id(parameter) -> fp32 master`` for the model's half parameters; a
            parameter without one (an fp32 island's) is used as it is.
        net_input: the batch's ``net_input`` (``model(**net_input)``).

    Returns:
        ``{module name: ||half - fp32|| / ||fp32||}`` in forward order, for the modules whose
        output has the same shape in both passes and a non-zero fp32 norm; ``inf`` where the
        half output is not finite.
    """
    model = _unwrapped(model)
    training = model.training
    model.eval()
    try:
        half_out = _outputs(model, net_input)
        ref_input = {k: v.float() if torch.is_tensor(v) and v.dtype in _HALF else v
                     for k, v in net_input.items()}  # token ids pass as they are
        with _as_fp32(model, masters):
            ref_out = _outputs(model, ref_input)
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
