"""Adam with decoupled weight decay for fp32 master weights (pure torch).

:func:`build_adam` returns ``torch.optim.AdamW`` on torch's fused kernel where
the parameters' device has one (CUDA and CPU do), ``foreach`` otherwise, or
apex's ``FusedAdam`` when apex is installed and asked for. Without bias
correction (``bias_correction=False``, apex's option that torch lacks) it
returns :class:`AdamWNoBiasCorrection`, a small foreach implementation.

Parameters are split into a decay group and a no-decay group by name.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.optim import optimizer as optim_hooks

from .param_names import param_name

__all__ = ["ADAM_BACKENDS", "build_adam", "copy_half_grads", "load_state_keeping_backend",
           "split_no_decay", "AdamWNoBiasCorrection", "FusedAdamWLists", "fused_adamw_kernel_matches"]

ADAM_BACKENDS = ("auto", "fused", "foreach", "apex")
#: Param-group entries that say how torch's optimizers compute, not what they optimize.
BACKEND_KEYS = ("fused", "foreach", "capturable", "differentiable")


def load_state_keeping_backend(optimizer: torch.optim.Optimizer, state: Dict) -> None:
    """``optimizer.load_state_dict(state)``, keeping this run's kernel choice.

    torch's optimizers store ``fused``/``foreach`` in their param groups, and loading a state
    restores the saved ones: a checkpoint of a ``foreach`` (or no-bias-correction) run resumed
    with the fused backend would run with flags its optimizer was not built for.
    """
    kept = [{k: g[k] for k in BACKEND_KEYS if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, own in zip(optimizer.param_groups, kept):
        for key in BACKEND_KEYS:
            group.pop(key, None)
        group.update(own)


def copy_half_grads(pairs: Iterable[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each (half parameter, fp32 master) pair's gradient into the master's ``.grad`` (made
    where missing), in one foreach copy; a half parameter without a gradient leaves its
    master's None."""
    src, dst = [], []
    for half, master in pairs:
        if half.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        src.append(half.grad)
        dst.append(master.grad)
    if dst:
        torch._foreach_copy_(dst, src)


def split_no_decay(
    params: Sequence[torch.Tensor], patterns: str, weight_decay: float
) -> List[Dict]:
    """Two param groups: names containing any comma-separated pattern get no decay.

    Parameters without a recorded name always decay. Empty groups are dropped.
    """
    pats = [s.strip() for s in (patterns or "").split(",") if s.strip()]
    decay, no_decay = [], []
    for p in params:
        name = param_name(p)
        (no_decay if name and any(s in name for s in pats) else decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _fused_available(device: torch.device) -> bool:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return device.type in _get_fused_kernels_supported_devices()


def build_adam(
    params: Sequence[torch.Tensor],
    *,
    lr: float,
    betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    no_decay_params: str = "bias,layer_norm,layernorm_embedding",
    bias_correction: bool = True,
    backend: str = "auto",
) -> torch.optim.Optimizer:
    """Build the Adam(W) optimizer for ``params`` (fp32 masters or fp32 model).

    Raises:
        ValueError: for an unknown ``backend`` (``--adam-backend``), or
            ``apex`` when apex is not installed.
    """
    if backend not in ADAM_BACKENDS:
        raise ValueError(
            f"--adam-backend must be one of {', '.join(ADAM_BACKENDS)}, got {backend!r}"
        )
    params = list(params)
    groups = split_no_decay(params, no_decay_params, weight_decay)
    kw = dict(lr=lr, betas=tuple(betas), eps=eps)
    if backend == "apex":
        try:
            from apex.optimizers import FusedAdam  # optional backend
        except ImportError:
            raise ValueError(
                "--adam-backend apex needs NVIDIA apex, which is not installed; "
                "use --adam-backend auto (torch's fused AdamW)"
            ) from None
        return FusedAdam(groups, adam_w_mode=True, bias_correction=bias_correction, **kw)
    if not bias_correction:
        return AdamWNoBiasCorrection(groups, **kw)
    device = params[0].device
    if backend == "fused" and not _fused_available(device):
        raise ValueError(f"--adam-backend fused: torch has no fused AdamW on {device.type}")
    fused = backend == "fused" or (backend == "auto" and _fused_available(device))
    if fused:
        return torch.optim.AdamW(groups, fused=True, **kw)
    return torch.optim.AdamW(groups, foreach=True, **kw)


#: The private kernel :class:`FusedAdamWLists` calls, as torch 2.13 declares it; another
#: declaration leaves the step to ``AdamW.step``.
FUSED_ADAMW_SCHEMA = (
    "aten::_fused_adamw_(Tensor(a!)[] self, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, "
    "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor[] state_steps, *, float lr, "
    "float beta1, float beta2, float weight_decay, float eps, bool amsgrad, bool maximize, "
    "Tensor? grad_scale=None, Tensor? found_inf=None) -> ()"
)


def _fused_adamw_schemas() -> List[str]:
    try:
        return [str(s) for s in torch._C._jit_get_schemas_for_operator("aten::_fused_adamw_")]
    except Exception:  # a torch without the operator, or without this introspection
        return []


_KERNEL_MATCHES: Optional[bool] = None


def fused_adamw_kernel_matches() -> bool:
    """Whether this torch declares ``torch._fused_adamw_`` as :data:`FUSED_ADAMW_SCHEMA` (read
    once). The kernel is private: a torch that changed it keeps ``AdamW.step``'s own call."""
    global _KERNEL_MATCHES
    if _KERNEL_MATCHES is None:
        _KERNEL_MATCHES = FUSED_ADAMW_SCHEMA in _fused_adamw_schemas()
    return _KERNEL_MATCHES


class FusedAdamWLists:
    """``torch.optim.AdamW(fused=True).step()`` on tensor lists built once.

    torch's step walks every parameter in Python on each call (gradient and state lookups,
    six list appends) and then regroups the lists by device and dtype: host time that grows
    with the tensors, and that a fast GPU waits on (``bench_optimizer.py``'s fixed cost times
    both ways). Here the lists of parameters, moments and step counts of each param group are
    built once every parameter has its state, and are kept while the optimizer holds the same
    state dict (``load_state_dict`` makes a new one) and the same groups (``add_param_group``
    adds one). Each call reads the gradients and makes torch's own calls: the step counts
    incremented, ``torch._fused_adamw_``, and the increment taken back where ``found_inf`` is
    set. The update is therefore bit-identical to ``optimizer.step()``.

    :meth:`step` returns False and does nothing where torch's step must run instead: a
    parameter without a gradient or without state (the first step), step hooks, a tensor
    learning rate, amsgrad, ``maximize``, ``capturable``, tensors on several devices or
    dtypes, or a torch whose ``_fused_adamw_`` is not the one this class was written for
    (:func:`fused_adamw_kernel_matches`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._key: Tuple = ()
        self._lists: List[Tuple[List[torch.Tensor], ...]] = []

    @staticmethod
    def supports(optimizer: torch.optim.Optimizer) -> bool:
        """True for a fused ``torch.optim.AdamW`` whose groups this class can step."""
        return type(optimizer) is torch.optim.AdamW and fused_adamw_kernel_matches() and all(
            g.get("fused") and g.get("decoupled_weight_decay", True) and not g.get("amsgrad")
            and not g.get("maximize") and not g.get("capturable") and not g.get("differentiable")
            for g in optimizer.param_groups)

    def _current_key(self) -> Tuple:
        """What the lists were built from: the state dict, and each group's parameter list."""
        opt = self.optimizer
        return (id(opt.state), *((id(g["params"]), len(g["params"])) for g in opt.param_groups))

    def _build(self) -> bool:
        """The lists of every group, or none (False): a group left out would not be stepped."""
        opt = self.optimizer
        self._key, self._lists = self._current_key(), []
        if not self.supports(opt):
            return False
        first = opt.param_groups[0]["params"][0]
        lists = []
        for group in opt.param_groups:
            params = list(group["params"])
            states = [opt.state.get(p) for p in params]
            if any(not st for st in states):
                return False
            group_lists = (params, [st["exp_avg"] for st in states],
                           [st["exp_avg_sq"] for st in states], [st["step"] for st in states])
            for t in (t for tensors in group_lists for t in tensors):
                if (t.device, t.dtype) != (first.device, first.dtype):
                    return False
            lists.append(group_lists)
        self._lists = lists
        return True

    def step(self, grad_scale: torch.Tensor, found_inf: torch.Tensor) -> bool:
        """One AdamW step of every group on gradients divided by ``grad_scale``, skipped
        (step counts kept) where ``found_inf`` is 1; False: nothing done, use torch's step."""
        opt = self.optimizer
        if (optim_hooks._global_optimizer_pre_hooks or optim_hooks._global_optimizer_post_hooks
                or opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks):
            return False
        if not self._lists or self._key != self._current_key():
            if not self._build():
                return False
        grads = []
        for params, *_ in self._lists:
            g = [p.grad for p in params]
            if any(x is None for x in g):
                return False
            grads.append(g)
        if any(torch.is_tensor(x) for group in opt.param_groups for x in (group["lr"], *group["betas"])):
            return False
        with torch.no_grad():
            for group, (params, exp_avgs, exp_avg_sqs, steps), g in zip(opt.param_groups, self._lists, grads):
                beta1, beta2 = group["betas"]
                torch._foreach_add_(steps, 1)
                torch._fused_adamw_(params, g, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False,
                                    lr=group["lr"], beta1=beta1, beta2=beta2,
                                    weight_decay=group["weight_decay"], eps=group["eps"],
                                    maximize=False, grad_scale=grad_scale, found_inf=found_inf)
                torch._foreach_sub_(steps, [found_inf] * len(steps))
        return True


class AdamWNoBiasCorrection(torch.optim.Optimizer):
    """AdamW without bias correction (apex ``FusedAdam(bias_correction=False)``).

    ``p <- p * (1 - lr * wd) - lr * m / (sqrt(v) + eps)`` with the raw moments.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            for p in params:
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1
            m = [self.state[p]["exp_avg"] for p in params]
            v = [self.state[p]["exp_avg_sq"] for p in params]
            b1, b2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            if wd != 0:
                torch._foreach_mul_(params, 1 - lr * wd)
            torch._foreach_lerp_(m, grads, 1 - b1)
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, grads, grads, 1 - b2)
            denom = torch._foreach_sqrt(v)
            torch._foreach_add_(denom, group["eps"])
            torch._foreach_addcdiv_(params, m, denom, -lr)
        return loss

