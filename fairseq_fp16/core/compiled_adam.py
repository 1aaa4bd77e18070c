"""The mixed-precision AdamW step as one ``torch.compile``'d pass per parameter (pure torch).

Eager, a half parameter's step makes four passes over memory: its half gradient copied into an
fp32 master gradient (2 + 4 bytes a parameter), the norm over that (4), torch's fused AdamW
(28) and the master rounded into the model (4 + 2): 44 bytes. torch has no eager kernel that
takes a half gradient into an fp32 master or writes a half copy. :class:`CompiledMixedAdamW`
sums the half gradient's squares for the norm (2 bytes) and then runs one loop that reads the
half gradient, the master and the moments and writes the master, the moments and the half
weight (30 bytes): no fp32 gradient exists. The update is ``torch.optim.AdamW``'s within fp32
rounding, and its state is the optimizer's own (``exp_avg``, ``exp_avg_sq``, ``step``), so a
checkpoint is the same either way (``--compile-step``).

Each call of a compiled function costs ~0.1 ms on the host, a transformer has ~100 large
tensors, and a compiled function over a list of tensors compiles in a time that grows faster
than the list: tensors of the same size are therefore stepped four to a call, on one compiled
graph, and the others one to a call. Their squares are summed eight (or four) to a call, in one
loop that reads them all at once: the CPU reads one stream at half the speed it reads several
(``scripts/bench_optimizer.py``'s ``compiled_passes_ms``).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch.optim import optimizer as optim_hooks

from .adam import FusedAdamWLists, copy_half_grads
from .compile import compile_dynamic

__all__ = ["CompiledMixedAdamW"]


#: elements of the tensors the kernels are first compiled on: inductor sizes its loops (whether
#: they run on every thread) by the first call's sizes, so they must be a large tensor's
WARM_UP_NUMEL = 1 << 20
#: half parameters with fewer elements are stepped by torch's eager passes, all in one call each
SMALL = 1 << 14
#: large half parameters of one size stepped by one call of the compiled loop (a graph over a
#: list compiles in seconds at four tensors, in a minute at 32; four takes most of the saving)
GROUP = 4
#: large half gradients of one size whose squares are summed by one loop, the larger first
NORM_GROUPS = (8, 4)


def _adamw_update(master, grad, exp_avg, exp_avg_sq, step, hyper, inv_scale, found_inf, half):
    """One tensor's AdamW update in one loop: ``grad`` (the half parameter's) times
    ``inv_scale``; ``master``, the moments and ``half`` (the model's half copy) written in
    place; ``step`` (torch's count) one more. Nothing changes where ``found_inf`` is set.
    ``hyper``: lr, beta1, beta2, weight decay and eps in float64, a tensor, so that a new
    learning rate compiles nothing; the bias corrections are taken in float64 from the new
    count, as torch's fused kernel takes them."""
    count = step + 1
    lr64, beta1_64, beta2_64 = hyper[0], hyper[1], hyper[2]
    # stacked: a buffer of two, which inductor computes once, not in each element's loop
    step_size, root_correction2 = torch.stack([lr64 / (1 - beta1_64 ** count.double()),
                                               (1 - beta2_64 ** count.double()).sqrt()]).float().unbind()
    lr, beta1, beta2, decay, eps = hyper.float().unbind()
    g = grad.float() * inv_scale
    m = exp_avg + (g - exp_avg) * (1 - beta1)
    v = exp_avg_sq * beta2 + g * g * (1 - beta2)
    p = master * (1 - lr * decay) - step_size * m / (v.sqrt() / root_correction2 + eps)
    skip = found_inf > 0
    exp_avg.copy_(torch.where(skip, exp_avg, m))
    exp_avg_sq.copy_(torch.where(skip, exp_avg_sq, v))
    p = torch.where(skip, master, p)
    master.copy_(p)
    half.copy_(p)
    step.copy_(count - found_inf)


def _sum_of_squares(grad):
    g = grad.float()
    return (g * g).sum()


def _adamw_update_group(masters, grads, exp_avgs, exp_avg_sqs, steps, halves, hyper, inv_scale,
                        found_inf):
    """:func:`_adamw_update` on :data:`GROUP` tensors of one size in one call."""
    for master, grad, exp_avg, exp_avg_sq, step, half in zip(
            masters, grads, exp_avgs, exp_avg_sqs, steps, halves):
        _adamw_update(master, grad, exp_avg, exp_avg_sq, step, hyper, inv_scale, found_inf, half)


def _sum_of_squares_group(grads):
    """The squares of gradients of one size summed in one loop over all of them."""
    squares = [g.float() * g.float() for g in grads]
    return sum(squares[1:], squares[0]).sum()


def _batches(rows: List[Tuple[torch.Tensor, ...]], sizes=(GROUP,)) -> Tuple[List[List[int]], List[int]]:
    """The indices of ``rows`` in groups of one size and dtype, as many of ``sizes[0]`` as there
    are, then of ``sizes[1]``..., and the rest's."""
    by_kind: Dict[Tuple, List[int]] = {}
    for i, row in enumerate(rows):
        by_kind.setdefault((row[0].numel(), row[4].dtype), []).append(i)
    batches, singles = [], []
    for indices in by_kind.values():
        for size in sizes:
            full = len(indices) - len(indices) % size
            batches += [indices[i:i + size] for i in range(0, full, size)]
            indices = indices[full:]
        singles += indices
    return batches, singles


class _Group:
    """One param group's tensors: the large half parameters' rows (flat master, gradient
    source, flat moments, flat half copy, step count), and the rest (fp32 islands
    and small tensors) as the lists torch's fused kernel takes."""

    def __init__(self) -> None:
        self.rows: List[Tuple[torch.Tensor, ...]] = []
        self.batches: List[List[int]] = []  # rows stepped GROUP to a call (_batches)
        self.singles: List[int] = []
        self.norm_batches: List[List[int]] = []  # rows whose squares one call sums (NORM_GROUPS)
        self.norm_singles: List[int] = []
        self.masters: List[torch.Tensor] = []
        self.sources: List[torch.Tensor] = []  # whose .grad each master takes (itself: fp32)
        self.exp_avgs: List[torch.Tensor] = []
        self.exp_avg_sqs: List[torch.Tensor] = []
        self.steps: List[torch.Tensor] = []
        self.halves: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (half, master) to round

    def grads(self) -> List[torch.Tensor]:
        """The fused kernel's fp32 gradients: an island's own, a small half one's master's (made
        by :meth:`copy_grads`)."""
        return [m.grad for m in self.masters]

    def copy_grads(self) -> None:
        """The small half parameters' gradients into fp32 master gradients."""
        copy_half_grads(self.halves)


class CompiledMixedAdamW:
    """torch's fused AdamW over fp32 masters, stepped from the model's half gradients in one
    compiled loop a parameter (the module's docstring has the bytes).

    Each call of a compiled loop costs tens of microseconds on the host, more than a bias's
    bytes take: fp32 parameters (the fp32 islands, their own masters) and half ones under
    :data:`SMALL` elements take torch's eager passes instead, each over all of them at once.

    Args:
        optimizer: a fused ``torch.optim.AdamW`` over the masters
            (:meth:`~fairseq_fp16.core.adam.FusedAdamWLists.supports`).
        halves: ``id(master) -> the model's half parameter``, whose gradient the master takes
            and which it is rounded into; a master missing here is its own model parameter (an
            fp32 island).

    Raises:
        ValueError: naming ``--compile-step``, for another optimizer, or where torch.compile
            cannot build the kernels on this machine: they are compiled here, on a tensor of
            each half dtype, so that no training step fails half way.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, halves: Dict[int, torch.Tensor]) -> None:
        if not FusedAdamWLists.supports(optimizer):
            raise ValueError("--compile-step compiles torch's fused AdamW update: use --optimizer "
                             "fp16_adam (with --adam-backend auto or fused, and bias correction)")
        self.optimizer = optimizer
        self._halves = halves
        self._key: Tuple = ()
        self._groups: List[_Group] = []
        self._update = compile_dynamic(_adamw_update)
        self._squares = compile_dynamic(_sum_of_squares)
        self._update_group = compile_dynamic(_adamw_update_group)
        self._squares_group = compile_dynamic(_sum_of_squares_group)
        try:
            self._warm_up()
        except Exception as e:  # no C++ compiler, no triton: the run must not start
            first = str(e).splitlines()[0] if str(e) else ""
            raise ValueError(f"--compile-step: torch.compile cannot build the AdamW update on this "
                             f"machine ({type(e).__name__}: {first}); run without --compile-step") from e

    def _warm_up(self) -> None:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        device = params[0].device
        one, zero = torch.ones((), device=device), torch.zeros((), device=device)
        hyper = torch.tensor([1e-3, 0.9, 0.999, 0.0, 1e-8], dtype=torch.float64, device=device)
        for dtype in sorted({h.dtype for h in self._halves.values()}, key=str):
            def fp32():
                return [torch.zeros(WARM_UP_NUMEL, device=device) for _ in range(GROUP)]

            def half(count=GROUP):
                return [torch.zeros(WARM_UP_NUMEL, dtype=dtype, device=device) for _ in range(count)]

            masters, grads, exp_avgs, exp_avg_sqs, halves = fp32(), half(), fp32(), fp32(), half()
            self._squares(grads[0])
            for count in NORM_GROUPS:
                self._squares_group(half(count))
            with torch.no_grad():  # as step() calls them: grad mode is in the graphs' guards
                steps = [torch.zeros((), device=device) for _ in range(GROUP)]
                self._update(masters[0], grads[0], exp_avgs[0], exp_avg_sqs[0], steps[0], hyper,
                             one, zero, halves[0])
                self._update_group(masters, grads, exp_avgs, exp_avg_sqs, steps, halves, hyper,
                                   one, zero)

    def _current_key(self) -> Tuple:
        opt = self.optimizer
        return (id(opt.state), *((id(g["params"]), len(g["params"])) for g in opt.param_groups))

    def _build(self) -> bool:
        """Each group's tensors (:class:`_Group`); False where a master has no state yet (the
        first step is torch's) or a tensor is not contiguous."""
        opt = self.optimizer
        self._key, self._groups = self._current_key(), []
        groups = []
        for group in opt.param_groups:
            g = _Group()
            for p in group["params"]:
                st = opt.state.get(p)
                if not st:
                    return False
                half = self._halves.get(id(p))
                if half is not None and half.numel() >= SMALL:
                    tensors = (p, st["exp_avg"], st["exp_avg_sq"], half)
                    if not all(t.is_contiguous() for t in tensors):
                        return False
                    flat = [t.detach().view(-1) for t in tensors]
                    g.rows.append((flat[0], half, flat[1], flat[2], flat[3], st["step"]))
                    continue
                g.masters.append(p)
                g.sources.append(p if half is None else half)
                g.exp_avgs.append(st["exp_avg"])
                g.exp_avg_sqs.append(st["exp_avg_sq"])
                g.steps.append(st["step"])
                if half is not None:
                    g.halves.append((half, p))
            g.batches, g.singles = _batches(g.rows)
            g.norm_batches, g.norm_singles = _batches(g.rows, NORM_GROUPS)
            groups.append(g)
        self._groups = groups
        return True

    def ready(self) -> bool:
        """Whether :meth:`norm` and :meth:`step` can run: every master has its state and every
        gradient source a gradient, and nothing asks for torch's own ``step`` (step hooks, a
        tensor learning rate). Where not, the eager step runs this time."""
        opt = self.optimizer
        if (optim_hooks._global_optimizer_pre_hooks or optim_hooks._global_optimizer_post_hooks
                or opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks):
            return False
        if any(torch.is_tensor(x) for g in opt.param_groups for x in (g["lr"], *g["betas"])):
            return False
        if (not self._groups or self._key != self._current_key()) and not self._build():
            return False
        return all(row[1].grad is not None for g in self._groups for row in g.rows) and \
            all(s.grad is not None for g in self._groups for s in g.sources)

    def norm(self) -> torch.Tensor:
        """The L2 norm of the model's (still scaled) gradients, summed in fp32: the large half
        ones' squares compiled, the rest's norms over fp32 gradients (the small half ones'
        copied into their masters' here, for :meth:`step`)."""
        sums = []
        for g in self._groups:
            grads = [row[1].grad.reshape(-1) for row in g.rows]
            sums += [self._squares_group([grads[i] for i in b]) for b in g.norm_batches]
            sums += [self._squares(grads[i]) for i in g.norm_singles]
            g.copy_grads()
            if g.masters:
                sums.append(torch.stack(torch._foreach_norm(g.grads(), 2)).square().sum())
        return torch.stack(sums).sum().sqrt()

    def step(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        """One AdamW step on the gradients times ``inv_scale``, rounded into the half
        parameters; skipped (step counts kept) where ``found_inf`` is 1. After :meth:`norm`."""
        inv_scale = inv_scale.float()
        with torch.no_grad():
            for group, g in zip(self.optimizer.param_groups, self._groups):
                lr, (beta1, beta2) = group["lr"], group["betas"]
                if g.rows:
                    hyper = torch.tensor([lr, beta1, beta2, group["weight_decay"], group["eps"]],
                                         dtype=torch.float64, device=inv_scale.device)
                    for batch in g.batches:
                        rows = [g.rows[i] for i in batch]
                        self._update_group([r[0] for r in rows], [r[1].grad.reshape(-1) for r in rows],
                                           [r[2] for r in rows], [r[3] for r in rows], [r[5] for r in rows],
                                           [r[4] for r in rows], hyper, inv_scale, found_inf)
                    for i in g.singles:
                        master, source, exp_avg, exp_avg_sq, half, step = g.rows[i]
                        self._update(master, source.grad.reshape(-1), exp_avg, exp_avg_sq, step, hyper,
                                     inv_scale, found_inf, half)
                if g.masters:
                    torch._foreach_add_(g.steps, 1)
                    torch._fused_adamw_(g.masters, g.grads(), g.exp_avgs, g.exp_avg_sqs, [], g.steps,
                                        amsgrad=False, lr=lr, beta1=beta1, beta2=beta2,
                                        weight_decay=group["weight_decay"], eps=group["eps"],
                                        maximize=False, grad_scale=torch.reciprocal(inv_scale),
                                        found_inf=found_inf)
                    torch._foreach_sub_(g.steps, [found_inf] * len(g.steps))
                    if g.halves:
                        torch._foreach_copy_([h for h, _ in g.halves], [m for _, m in g.halves])
