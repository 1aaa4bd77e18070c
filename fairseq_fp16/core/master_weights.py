"""fp32 master weights for a half-precision model (pure torch, no fairseq import).

:class:`MixedPrecisionOptimizer` is the classic apex recipe on modern torch:

1. ``backward``: the fp32 loss is multiplied by the loss scale, gradients land
   in the fp16/bf16 model parameters;
2. ``clip_grad_norm``: the half gradients are copied into fp32 master
   gradients and their norm is taken and unscaled; an overflow shows up as a
   non-finite norm and is written into a ``found_inf`` tensor; clipping is
   folded into the unscale factor, so no pass over the gradients is spent on it;
3. ``step``: the inner optimizer updates the fp32 masters from the master
   gradients, and the masters are rounded back into the model. An inner optimizer that declares ``_step_supports_amp_scaling``
   (torch's fused Adam/AdamW, on CUDA and CPU) receives ``grad_scale`` and
   ``found_inf``: it unscales inside the kernel and skips the update on
   overflow, so the step needs no host sync. Other optimizers are unscaled
   with ``torch._amp_foreach_non_finite_check_and_unscale_`` and skipped on the
   host (one sync).

Parameters that are already fp32 in the model (fp32 islands such as LayerNorm)
are their own masters: they are updated in place and not copied.

With ``compile_step`` (``--compile-step``) steps 2 and 3 read the half gradients of large
parameters directly: the norm sums their squares and one compiled loop a parameter updates the
master, the moments and the half weight
(:class:`~fairseq_fp16.core.compiled_adam.CompiledMixedAdamW`); their fp32 master gradients are
made only on a step that the loops cannot take (the first, whose optimizer state torch
creates).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .adam import FusedAdamWLists, copy_half_grads, load_state_keeping_backend
from .compiled_adam import CompiledMixedAdamW
from .loss_scaler import LossScaler
from .param_names import CARRIED_ATTRS, NAME_ATTR, param_name, tag_param_names

__all__ = ["MixedPrecisionOptimizer", "HALF_DTYPES"]

HALF_DTYPES = (torch.float16, torch.bfloat16)

class MixedPrecisionOptimizer:
    """fp32 master weights + loss scaling around a torch optimizer.

    Args:
        params: the model's parameters (half, or fp32 for fp32 islands).
        build_optimizer: called with the master parameters, returns the
            torch optimizer that updates them.
        scaler: the :class:`LossScaler`; its device must be the params'.
        compile_step: step large parameters from their half gradients, one compiled loop each
            (:class:`~fairseq_fp16.core.compiled_adam.CompiledMixedAdamW`).

    Raises:
        ValueError: for a parameter that is neither half nor fp32; with ``compile_step``, for
            an inner optimizer other than torch's fused AdamW, parameters on several devices or
            marked as experts, or a machine where torch.compile cannot build the step.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        build_optimizer: Callable[[List[torch.Tensor]], torch.optim.Optimizer],
        scaler: LossScaler,
        compile_step: bool = False,
    ) -> None:
        self.model_params: List[torch.nn.Parameter] = list(params)
        if not self.model_params:
            raise ValueError("MixedPrecisionOptimizer got no parameters")
        self.scaler = scaler
        self.master_params: List[torch.Tensor] = []
        self._half_pairs: List[tuple] = []  # (model param, master param)
        self._half_index: List[int] = []  # position of each pair in model_params
        for i, p in enumerate(self.model_params):
            if p.dtype in HALF_DTYPES:
                master = torch.nn.Parameter(p.detach().float(), requires_grad=True)
                for attr in CARRIED_ATTRS:
                    if hasattr(p, attr):
                        setattr(master, attr, getattr(p, attr))
                self._half_pairs.append((p, master))
                self._half_index.append(i)
                self.master_params.append(master)
            elif p.dtype == torch.float32:
                self.master_params.append(p)
            else:
                raise ValueError(f"unsupported parameter dtype {p.dtype}")
        # the lists each step walks, built once: an update on a fast GPU is bound by the host
        self._half_models = [p for p, _ in self._half_pairs]
        self._half_masters = [m for _, m in self._half_pairs]
        self._normed = [m for m in self.master_params if not hasattr(m, "expert")]
        self._experts = [m for m in self.master_params if hasattr(m, "expert")]
        self._one_device = len({m.device for m in self.master_params}) == 1
        self.optimizer = build_optimizer(self.master_params)
        self.fused_amp = bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))
        # torch's fused AdamW stepped on lists built once (None: the optimizer's own step)
        self._fused_lists = FusedAdamWLists(self.optimizer) if FusedAdamWLists.supports(self.optimizer) else None
        self._compiled: Optional[CompiledMixedAdamW] = None
        if compile_step:
            if self._experts or not self._one_device:
                raise ValueError("--compile-step steps parameters of one device, none of them "
                                 "experts (expert parallelism)")
            self._compiled = CompiledMixedAdamW(self.optimizer, {id(m): p for p, m in self._half_pairs})
        self._one_pass = False  # this step's norm and update run compiled from the half grads
        device = self.model_params[0].device
        self._found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self._one = torch.ones((), dtype=torch.float32, device=device)
        self._multiplier: float | torch.Tensor = 1.0
        self._inv_scale: Optional[torch.Tensor] = None  # unscale * clip factor
        self._grads_synced = False  # master grads hold this step's gradients
        self._known_finite = False  # the caller saw this step's norm finite on the host

    @property
    def compiles_step(self) -> bool:
        """Whether steps after the first run compiled from the half gradients (``compile_step``)."""
        return self._compiled is not None

    def masters_by_param(self) -> Dict[int, torch.Tensor]:
        """``id(model parameter) -> its fp32 master``, for the half parameters."""
        return {id(p): master for p, master in self._half_pairs}

    def half_params(self) -> List[Tuple[int, torch.Tensor]]:
        """``(position in model_params, model parameter)`` of each half parameter (each has an
        fp32 master)."""
        return list(zip(self._half_index, (p for p, _ in self._half_pairs)))

    # ---------------------------------------------------------------- backward
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss * scale`` into the model's half gradients."""
        self.scaler.scale(loss).backward()

    def multiply_grads(self, c: float | torch.Tensor) -> None:
        """Multiply gradients by ``c`` lazily (folded into the unscale).

        After :meth:`clip_grad_norm` the factor multiplies the unscale-and-clip factor it
        computed, so the clip coefficient is kept (fairseq multiplies the clipped gradients).
        """
        self._multiplier = self._multiplier * c
        if self._inv_scale is not None:
            self._inv_scale = self._inv_scale * (c.to(self._inv_scale.device).float()
                                                 if torch.is_tensor(c) else float(c))

    # ------------------------------------------------------------ grad checks
    def clip_grad_norm(self, max_norm: float = 0.0) -> torch.Tensor:
        """Unscaled gradient norm (fp32 tensor); sets ``found_inf``; no sync.

        The half gradients are copied into the fp32 master gradients first (the
        step needs them there anyway) and the norm is taken over those, which on
        CPUs is faster than an fp16 norm with fp32 accumulation. With
        ``max_norm > 0`` the clip coefficient is folded into the factor the
        step applies, not applied to the gradients here.
        """
        self._one_pass = self._compiled is not None and self._compiled.ready()
        if not self._one_pass:
            self._sync_master_grads()
        device = self._found_inf.device
        # 1/scale: an IEEE division, exact for the power-of-two scales and correctly rounded
        # for any other (a --threshold-loss-scale floor, a tolerance)
        inv = torch.reciprocal(self.scaler.scale_tensor)
        mult = self._multiplier
        if torch.is_tensor(mult) or mult != 1.0:
            inv = inv * (mult.to(device).float() if torch.is_tensor(mult) else float(mult))
        normed = [m.grad for m in self._normed if m.grad is not None]
        experts = [m.grad for m in self._experts if m.grad is not None]
        if self._one_pass:
            total = self._compiled.norm()
        elif normed:
            norms = torch._foreach_norm(normed, 2)
            if not self._one_device:
                norms = [n.to(device) for n in norms]
            total = torch.linalg.vector_norm(torch.stack(norms))
        else:
            total = torch.zeros((), device=device)
        total = total * inv
        checked = [total]
        if experts:  # outside the norm, but an overflow there still skips the update
            checked.append(torch.stack([n.to(device) for n in torch._foreach_norm(experts, 2)]))
        # found_inf = 1 where the (unscaled) norm is not finite, in one kernel (the factor is 1)
        self._found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(checked, self._found_inf, self._one)
        if max_norm > 0:
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
            coef = torch.nan_to_num(coef, nan=1.0, posinf=1.0, neginf=1.0)
            inv = inv * coef
        self._inv_scale = inv
        self._known_finite = False
        return total

    @property
    def found_inf(self) -> torch.Tensor:
        """1.0 when the last :meth:`clip_grad_norm` saw a non-finite gradient."""
        return self._found_inf

    # -------------------------------------------------------------------- step
    def _sync_master_grads(self) -> List[torch.Tensor]:
        """Copy half grads into fp32 master grads (once per step); return all master grads."""
        if not self._grads_synced:
            copy_half_grads(self._half_pairs)
            self._grads_synced = True
        return [m.grad for m in self.master_params if m.grad is not None]

    def step(self) -> None:
        """Update the fp32 masters and round them into the model.

        No host sync when the inner optimizer is fused; one otherwise.
        """
        if self._inv_scale is None:
            self.clip_grad_norm(0.0)
        if self._one_pass:  # the norm saw the half gradients, and so does the update
            self._compiled.step(self._inv_scale, self._found_inf)
            self.scaler.update(self._found_inf)
            self._reset_step_state()
            return
        master_grads = self._sync_master_grads()
        if self.fused_amp:
            # The kernel divides by grad_scale and skips the update on found_inf.
            grad_scale = torch.reciprocal(self._inv_scale)
            if self._fused_lists is None or not self._fused_lists.step(grad_scale, self._found_inf):
                self.optimizer.grad_scale = grad_scale
                self.optimizer.found_inf = self._found_inf
                try:
                    self.optimizer.step()
                finally:
                    del self.optimizer.grad_scale
                    del self.optimizer.found_inf
        elif self._known_finite:
            # the caller read the norm on the host and saw no overflow: unscale and step,
            # no second sync
            if master_grads:
                torch._foreach_mul_(master_grads, self._inv_scale)
            self.optimizer.step()
        else:
            check = torch.zeros_like(self._found_inf)
            if master_grads:
                torch._amp_foreach_non_finite_check_and_unscale_(
                    master_grads, check, self._inv_scale
                )
            self._found_inf.copy_(torch.maximum(self._found_inf, check))
            if not bool(self._found_inf):  # the one host sync of this path
                self.optimizer.step()
        self._copy_masters_to_model()
        self.scaler.update(self._found_inf)
        self._reset_step_state()

    def note_finite(self) -> None:
        """Tell :meth:`step` that the norm of :meth:`clip_grad_norm` was read on the host and
        is finite (fairseq's trainer reads it anyway), so the unfused path skips its check."""
        self._known_finite = self._inv_scale is not None

    def _reset_step_state(self) -> None:
        self._multiplier = 1.0
        self._inv_scale = None
        self._grads_synced = False
        self._known_finite = False
        self._one_pass = False

    def _copy_masters_to_model(self) -> None:
        if self._half_pairs:
            with torch.no_grad():
                torch._foreach_copy_(self._half_models, self._half_masters)

    def skip_step(self) -> None:
        """Record an overflowed update without stepping (the caller detected it)."""
        self.scaler.update(self._found_inf)
        self._reset_step_state()

    def zero_grad(self) -> None:
        """Drop the model's gradients and the fp32 master gradients.

        The master gradients live only from the step's gradient copy to the next
        ``zero_grad`` (fairseq calls it before each forward), so the forward and
        backward, where activations peak, run without them: 4 bytes a half
        parameter off the peak, against keeping them as reused buffers (stock
        fairseq's ``--fp16`` keeps a flat fp32 gradient buffer).
        """
        for p in self.model_params:
            p.grad = None
        for _, m in self._half_pairs:
            m.grad = None
        self._reset_step_state()

    # -------------------------------------------------------------- state dict
    def state_dict(self) -> Dict[str, object]:
        """Inner optimizer, scaler and fp32 masters keyed by parameter position, with the
        name each carries (``master_names``). The masters are copied to the CPU (no second
        copy on the device at save time)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "master_params": {
                i: m.detach().to("cpu", copy=True) for i, (_, m) in zip(self._half_index, self._half_pairs)
            },
            "master_names": {i: param_name(m) for i, (_, m) in zip(self._half_index, self._half_pairs)},
        }

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Restore :meth:`state_dict`; masters absent = keep the current ones.

        Raises:
            ValueError: when saved masters do not fit the model's parameters.
        """
        masters = self._match_masters(state.get("master_params") or {}, state.get("master_names") or {})
        load_state_keeping_backend(self.optimizer, state["optimizer"])
        if state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        with torch.no_grad():
            for master, saved in masters:
                master.copy_(saved)
        self._copy_masters_to_model()

    def _match_masters(self, masters: Dict, names: Dict) -> List[tuple]:
        """(master, saved tensor) pairs: by the saved name where the checkpoint has names
        and every model parameter's name is known, else by position.

        Raises:
            ValueError: when a saved master fits no parameter.
        """
        by_index = dict(zip(self._half_index, self._half_pairs))
        by_name = {param_name(m): m for _, m in self._half_pairs}
        use_names = bool(names) and "" not in by_name and len(by_name) == len(self._half_pairs)
        pairs = []
        for i, saved in masters.items():
            name = names.get(i, names.get(int(i))) if use_names else None
            master = by_name.get(name) if name else (by_index.get(int(i)) or (None, None))[1]
            if master is None or saved.shape != master.shape:
                what = f"{name!r}" if name else f"at position {i}"
                raise ValueError(
                    f"checkpoint's fp32 master weight {what} {tuple(saved.shape)} matches no "
                    "parameter of the model; was it written by another architecture?"
                )
            pairs.append((master, saved))
        return pairs
