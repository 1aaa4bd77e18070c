"""fp16_adam's update against torch.optim.AdamW, the mixed-precision step, overflow skip."""

import copy
import io

import pytest
import torch

from fairseq_fp16.core.adam import AdamWNoBiasCorrection, build_adam, split_no_decay
from fairseq_fp16.core.host_sync import HostSyncCounter
from fairseq_fp16.core.loss_scaler import LossScaler
from fairseq_fp16.core.master_weights import MixedPrecisionOptimizer, tag_param_names

HP = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)


def make_params(seed=0, shapes=((64, 32), (32,), (7, 5, 3))):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def random_grads(params, step, scale=1.0, dtype=None):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        grad = torch.randn(p.shape, generator=g) * scale
        p.grad = grad.to(dtype or p.dtype)


@pytest.mark.parametrize("backend", ["fused", "foreach"])
def test_fp16_adam_matches_torch_adamw_over_60_steps(backend):
    ours, ref = make_params(), make_params()
    opt = build_adam(ours, no_decay_params="", backend=backend, **HP)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **HP)
    for step in range(60):
        random_grads(ours, step)
        random_grads(ref, step)
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert ours[0].sub(make_params()[0]).abs().max() > 0.1  # it did move


def test_auto_backend_is_fused_on_cpu():
    opt = build_adam(make_params(), **HP)
    assert opt.defaults["fused"] is True


def test_no_decay_grouping_by_name():
    lin, ln = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    model = torch.nn.ModuleDict({"fc": lin, "self_attn_layer_norm": ln})
    tag_param_names(model.named_parameters())
    groups = split_no_decay(list(model.parameters()), "bias,layer_norm", 0.3)
    assert [g["weight_decay"] for g in groups] == [0.3, 0.0]
    assert groups[0]["params"] == [lin.weight]
    assert {id(p) for p in groups[1]["params"]} == {id(lin.bias), id(ln.weight), id(ln.bias)}


def test_no_decay_params_really_skip_decay():
    w = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(3))
    tag_param_names([("fc.weight", w), ("fc.bias", b)])
    opt = build_adam([w, b], lr=0.1, weight_decay=0.5)
    w.grad, b.grad = torch.zeros(3), torch.zeros(3)
    opt.step()
    assert torch.allclose(w, torch.full((3,), 0.95)) and torch.equal(b, torch.ones(3))


def test_no_bias_correction_matches_formula():
    (p,) = make_params(shapes=((10,),))
    ref = p.detach().clone()
    opt = AdamWNoBiasCorrection([p], **HP)
    m, v = torch.zeros(10), torch.zeros(10)
    b1, b2 = HP["betas"]
    for step in range(5):
        random_grads([p], step)
        g = p.grad.clone()
        opt.step()
        ref.mul_(1 - HP["lr"] * HP["weight_decay"])
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        ref -= HP["lr"] * m / (v.sqrt() + HP["eps"])
    torch.testing.assert_close(p.detach(), ref, rtol=1e-6, atol=1e-7)


def test_unknown_backend_refused():
    with pytest.raises(ValueError, match=r"--adam-backend must be one of auto, fused, foreach, apex, got 'cuda'"):
        build_adam(make_params(), backend="cuda", **HP)


def test_apex_backend_refused_without_apex():
    try:
        import apex  # noqa: F401
        pytest.skip("apex is installed")
    except ImportError:
        pass
    with pytest.raises(ValueError, match=r"--adam-backend apex needs NVIDIA apex"):
        build_adam(make_params(), backend="apex", **HP)


# --------------------------------------------------------------------- mixed precision
def mixed(dtype=torch.float16, backend="fused", init_scale=1024.0, **scaler_kw):
    master_init = make_params()
    half = [torch.nn.Parameter(p.detach().to(dtype)) for p in master_init]
    scaler = LossScaler(init_scale, scale_window=1000, **scaler_kw)
    opt = MixedPrecisionOptimizer(half, lambda ps: build_adam(ps, backend=backend, no_decay_params="", **HP), scaler)
    return half, opt


@pytest.mark.parametrize("backend", ["fused", "foreach"])
def test_mixed_step_tracks_fp32_adamw_on_masters(backend):
    half, opt = mixed(backend=backend)
    ref = [torch.nn.Parameter(p.detach().float()) for p in half]  # same start as the masters
    ref_opt = torch.optim.AdamW(ref, foreach=False, **HP)
    scale = opt.scaler.loss_scale
    for step in range(20):
        # grads arrive scaled and in half precision
        random_grads(half, step, scale=scale, dtype=torch.float16)
        for r, h in zip(ref, half):
            r.grad = h.grad.float() / scale
        opt.clip_grad_norm(0.0)
        opt.step()
        ref_opt.step()
    for m, r, h in zip(opt.master_params, ref, half):
        torch.testing.assert_close(m, r, rtol=1e-5, atol=1e-6)
        assert torch.equal(h, m.detach().half())  # model = masters rounded


def test_zero_grad_releases_master_grads_and_steps_stay_those_of_adamw():
    half, opt = mixed()
    ref = [torch.nn.Parameter(p.detach().float()) for p in half]
    ref_opt = torch.optim.AdamW(ref, foreach=False, **HP)
    scale = opt.scaler.loss_scale
    for step in range(10):
        opt.zero_grad()  # as fairseq calls it, before each forward
        assert all(m.grad is None for m in opt.master_params)  # no fp32 grads through the backward
        random_grads(half, step, scale=scale, dtype=torch.float16)
        for r, h in zip(ref, half):
            r.grad = h.grad.float() / scale
        opt.clip_grad_norm(1.0)
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        opt.step()
        ref_opt.step()
        assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in opt.master_params)
    for m, r in zip(opt.master_params, ref):
        torch.testing.assert_close(m, r, rtol=1e-5, atol=1e-6)


def test_overflow_skips_update_bit_for_bit_and_backs_off():
    half, opt = mixed()
    random_grads(half, 0, dtype=torch.float16)
    opt.step()  # one real step: Adam state exists
    before = [m.detach().clone() for m in opt.master_params]
    state_before = {k: v.clone() for k, v in opt.optimizer.state[opt.master_params[0]].items()}
    random_grads(half, 1, dtype=torch.float16)
    half[1].grad[3] = float("inf")
    norm = opt.clip_grad_norm(1.0)
    assert not torch.isfinite(norm) and opt.found_inf.item() == 1.0
    opt.step()
    for m, b in zip(opt.master_params, before):
        assert torch.equal(m, b)
    for k, v in opt.optimizer.state[opt.master_params[0]].items():
        assert torch.equal(v, state_before[k]), k
    assert opt.scaler.loss_scale == 512.0


def test_fused_step_costs_no_host_sync_and_unfused_one():
    half, opt = mixed(backend="fused")
    random_grads(half, 0, dtype=torch.float16)
    with HostSyncCounter() as c:
        opt.multiply_grads(0.5)
        opt.clip_grad_norm(1.0)
        opt.step()
    assert c.count == 0, c.calls
    half, opt = mixed(backend="foreach")
    random_grads(half, 0, dtype=torch.float16)
    with HostSyncCounter() as c:
        opt.clip_grad_norm(1.0)
        opt.step()
    # our skip decision; torch's foreach AdamW also .item()s its step counters,
    # which live on the CPU (no device sync on a GPU).
    assert c.calls["__bool__"] == 1 and set(c.calls) <= {"__bool__", "item"}, c.calls
    # the caller read the norm on the host (fairseq's trainer does): no second sync
    random_grads(half, 1, dtype=torch.float16)
    norm = opt.clip_grad_norm(1.0)
    assert bool(torch.isfinite(norm))
    opt.note_finite()
    with HostSyncCounter() as c:
        opt.step()
    assert "__bool__" not in c.calls, c.calls


def test_clipping_folded_into_unscale():
    half, opt = mixed(init_scale=8.0)
    for p in half:
        p.grad = torch.full_like(p, 8.0 * 3.0)  # unscaled grad 3 everywhere
    n = sum(p.numel() for p in half)
    norm = opt.clip_grad_norm(1.0)
    torch.testing.assert_close(norm, torch.tensor(3.0 * n**0.5))
    # the effective unscale factor also applies the clip coefficient
    torch.testing.assert_close(opt._inv_scale, torch.tensor(1.0 / 8.0 / (3.0 * n**0.5)), rtol=1e-5, atol=0)


def test_bf16_model_and_fp32_islands_share_one_optimizer():
    w = torch.nn.Parameter(torch.randn(4, 4).bfloat16())
    ln = torch.nn.Parameter(torch.ones(4))  # an fp32 island parameter is its own master
    opt = MixedPrecisionOptimizer([w, ln], lambda ps: build_adam(ps, **HP), LossScaler(1.0, dynamic=False))
    assert opt.master_params[1] is ln and opt.master_params[0].dtype == torch.float32
    w.grad, ln.grad = torch.ones(4, 4).bfloat16(), torch.ones(4)
    opt.step()
    assert ln.detach().sub(1).abs().max() > 0 and w.dtype == torch.bfloat16


def test_state_round_trip_restores_masters_and_scale():
    half, opt = mixed()
    for step in range(3):
        random_grads(half, step, dtype=torch.float16)
        opt.step()
    opt.scaler.update(torch.tensor(1.0))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    half2, opt2 = mixed()
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    for a, b in zip(opt.master_params, opt2.master_params):
        assert torch.equal(a, b)
    for a, b in zip(half, half2):
        assert torch.equal(a, b)
    assert opt2.scaler.state_dict() == opt.scaler.state_dict()
    # and the next step is identical
    for o, h in ((opt, half), (opt2, half2)):
        random_grads(h, 9, dtype=torch.float16)
        o.step()
    for a, b in zip(opt.master_params, opt2.master_params):
        assert torch.equal(a, b)


def test_masters_of_another_architecture_refused():
    half, opt = mixed()
    state = opt.state_dict()
    state["master_params"][0] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"fp32 master weight at position 0 \(3, 3\) matches no parameter"):
        mixed()[1].load_state_dict(state)


def named_mixed(order=(0, 1, 2)):
    master_init = make_params()
    names = ["enc.w", "enc.b", "dec.w"]
    half = [torch.nn.Parameter(master_init[i].detach().half()) for i in order]
    for i, p in zip(order, half):
        p._fairseq_fp16_name = names[i]
    opt = MixedPrecisionOptimizer(half, lambda ps: build_adam(ps, no_decay_params="", **HP),
                                  LossScaler(1024.0, scale_window=1000))
    return half, opt


def test_masters_are_matched_by_their_name_and_saved_on_the_cpu():
    half, opt = named_mixed()
    random_grads(half, 0, dtype=torch.float16)
    opt.step()
    state = opt.state_dict()
    assert state["master_names"] == {0: "enc.w", 1: "enc.b", 2: "dec.w"}
    assert all(t.device.type == "cpu" and t.data_ptr() != m.data_ptr()
               for t, m in zip(state["master_params"].values(), opt.master_params))
    # a model that lists its parameters in another order gets each master by name
    half2, opt2 = named_mixed(order=(2, 0, 1))
    opt2.load_state_dict({**state, "optimizer": opt2.optimizer.state_dict()})
    by_name = {m._fairseq_fp16_name: m for m in opt.master_params}
    for m in opt2.master_params:
        assert torch.equal(m, by_name[m._fairseq_fp16_name])
    state["master_names"][1] = "enc.bias"
    with pytest.raises(ValueError, match=r"fp32 master weight 'enc.bias' \(32,\) matches no parameter"):
        named_mixed()[1].load_state_dict(state)


def test_multiply_after_clip_keeps_the_clip_coefficient():
    results = []
    for order in ("multiply first", "clip first"):
        half, opt = mixed()
        random_grads(half, 0, scale=10.0, dtype=torch.float16)
        if order == "clip first":
            opt.clip_grad_norm(1.0)
            opt.multiply_grads(0.5)
        else:
            opt.multiply_grads(0.5)
            opt.clip_grad_norm(0.5)  # fairseq's order: the norm seen after multiplying
        opt.step()
        results.append([m.detach().clone() for m in opt.master_params])
    # clipping to 1 then halving moves the masters as clipping the halved gradients to 0.5
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_master_weights_carry_the_attributes_fairseq_reads_and_experts_stay_out_of_the_norm():
    half = [torch.nn.Parameter(p.detach().half()) for p in make_params()]
    half[0].param_group, half[1].optim_overrides = "encoder", {"lr": 0.1}
    half[2].expert = True
    opt = MixedPrecisionOptimizer(half, lambda ps: build_adam(ps, no_decay_params="", **HP),
                                  LossScaler(1.0, dynamic=False))
    m = opt.master_params
    assert m[0].param_group == "encoder" and m[1].optim_overrides == {"lr": 0.1} and m[2].expert
    random_grads(half, 0, dtype=torch.float16)
    norm = opt.clip_grad_norm(0.0)
    expected = torch.linalg.vector_norm(torch.stack([h.grad.float().norm() for h in half[:2]]))
    torch.testing.assert_close(norm, expected)
    opt.zero_grad()  # an expert's overflow still skips the update
    random_grads(half, 1, dtype=torch.float16)
    half[2].grad[0, 0, 0] = float("inf")
    assert torch.isfinite(opt.clip_grad_norm(0.0)) and opt.found_inf.item() == 1.0


@pytest.mark.parametrize("saved,resumed", [("foreach", "fused"), ("fused", "foreach")])
def test_a_checkpoint_resumes_with_another_adam_backend(saved, resumed):
    half, opt = mixed(backend=saved)
    for step in range(3):
        random_grads(half, step, dtype=torch.float16)
        opt.step()
    state = copy.deepcopy(opt.state_dict())  # as read back from a file: no shared tensors
    half2, opt2 = mixed(backend=resumed)
    opt2.load_state_dict(state)
    group = opt2.optimizer.param_groups[0]
    assert group.get("fused") is (True if resumed == "fused" else None)
    assert bool(group.get("foreach")) is (resumed == "foreach")
    for o, h in ((opt, half), (opt2, half2)):  # and the next step is the same update
        random_grads(h, 9, dtype=torch.float16)
        o.step()
    for a, b in zip(opt.master_params, opt2.master_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_no_bias_correction_checkpoint_loads_into_the_fused_backend():
    half = [torch.nn.Parameter(p.detach().half()) for p in make_params()]
    opt = MixedPrecisionOptimizer(half, lambda ps: build_adam(ps, bias_correction=False, **HP),
                                  LossScaler(1.0, dynamic=False))
    random_grads(half, 0, dtype=torch.float16)
    opt.step()
    half2, opt2 = mixed(backend="fused")
    opt2.load_state_dict(opt.state_dict())
    assert opt2.optimizer.param_groups[0]["fused"] is True
    random_grads(half2, 1, dtype=torch.float16)
    opt2.step()  # runs (bias correction resumes from the saved step count)
    assert all(torch.isfinite(m).all() for m in opt2.master_params)


def _torch_steps(opt):
    """Count the steps the optimizer's own ``step`` takes (no hook: a hook is a fallback)."""
    calls = []
    own = opt.optimizer.step

    def counted(*a, **kw):
        calls.append(1)
        return own(*a, **kw)

    opt.optimizer.step = counted
    return calls


def test_fused_step_on_cached_lists_is_bit_identical_to_torch_adamw_step():
    """Two param groups, a new lr each step, overflows, a parameter without a gradient and a
    checkpoint loaded into the stepping optimizer: the cached path and torch's step agree bit
    for bit."""
    runs = {}
    for cached in (True, False):
        master_init = make_params()
        half = [torch.nn.Parameter(p.detach().half()) for p in master_init]
        tag_param_names([("w", half[0]), ("bias", half[1]), ("x", half[2])])
        opt = MixedPrecisionOptimizer(half, lambda ps: build_adam(ps, **HP), LossScaler(1024.0, scale_window=3))
        assert len(opt.optimizer.param_groups) == 2  # decay and no decay
        if not cached:
            opt._fused_lists = None
        calls, taken = _torch_steps(opt), []
        for step in range(12):
            if step == 4:
                saved = copy.deepcopy(opt.state_dict())
            if step == 6:  # back to the state of step 4: new tensors, the lists are rebuilt
                opt.load_state_dict(saved)
            opt.zero_grad()
            random_grads(half, step, scale=opt.scaler.loss_scale, dtype=torch.float16)
            if step in (3, 9):
                half[0].grad[0, 0] = float("inf")
            if step == 8:
                half[2].grad = None
            for group in opt.optimizer.param_groups:
                group["lr"] = 1e-2 / (step + 1)
            opt.clip_grad_norm(1.0)
            opt.step()
            taken.append(len(calls))
        runs[cached] = (opt.state_dict(), [h.detach().clone() for h in half], taken)
    (got, got_half, taken), (ref, ref_half, _) = runs[True], runs[False]
    # torch's step ran for the first step (no state yet) and for the step without a gradient
    assert taken == [1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2]
    for g, r in zip(got_half, ref_half):
        assert torch.equal(g, r)
    for i, m in ref["master_params"].items():
        assert torch.equal(got["master_params"][i], m)
    for k, st in ref["optimizer"]["state"].items():
        for name, t in st.items():
            assert torch.equal(got["optimizer"]["state"][k][name], t), (k, name)
    assert got["scaler"] == ref["scaler"]


def test_step_hooks_get_torch_step_and_run():
    half, opt = mixed()
    calls, seen = _torch_steps(opt), []
    for step in range(3):
        if step == 2:
            opt.optimizer.register_step_post_hook(lambda o, args, kwargs: seen.append(step))
        random_grads(half, step, scale=opt.scaler.loss_scale, dtype=torch.float16)
        opt.clip_grad_norm(0.0)
        opt.step()
    assert len(calls) == 2 and seen == [2]  # the first step (no state) and the hooked one


def _fused_pair(seed=0):
    """The same parameters twice, each in a fused AdamW with a decay and a no-decay group."""
    pairs = []
    for _ in range(2):
        w, b, x = make_params(seed)
        opt = torch.optim.AdamW([{"params": [w, x], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}],
                                fused=True, lr=1e-2, betas=(0.9, 0.98))
        pairs.append(opt)
    return pairs


@pytest.mark.parametrize("case", ["no-decay parameter without a gradient at step 1", "group added at step 4"])
def test_the_cached_lists_step_every_group_as_torch_adamw(case):
    """Every group is stepped as ``AdamW(fused=True).step()`` steps it: a group whose parameter
    had no state when the lists were first built, and a group added by ``add_param_group``."""
    from fairseq_fp16.core.adam import FusedAdamWLists

    ours, ref = _fused_pair()
    lists = FusedAdamWLists(ours)
    one, zero = torch.ones(()), torch.zeros(())
    cached = []
    for step in range(8):
        if case.startswith("group added") and step == 4:
            for opt in (ours, ref):
                opt.add_param_group({"params": [torch.nn.Parameter(torch.full((5,), 0.5))], "weight_decay": 0.0})
        for opt in (ours, ref):
            params = [p for g in opt.param_groups for p in g["params"]]
            random_grads(params, step)
            if case.startswith("no-decay") and step == 0:
                opt.param_groups[1]["params"][0].grad = None
        ok = lists.step(one, zero)
        if not ok:
            ours.step()
        cached.append(ok)
        ref.step()
    expected = [False, True, True, True, False, True, True, True] if case.startswith("group added") \
        else [False, False, True, True, True, True, True, True]
    assert cached == expected
    for group, ref_group in zip(ours.param_groups, ref.param_groups):
        for p, r in zip(group["params"], ref_group["params"]):
            assert torch.equal(p, r)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(ours.state[p][key], ref.state[r][key]), key


def test_a_torch_whose_fused_kernel_differs_steps_with_adamw_step(monkeypatch):
    from fairseq_fp16.core import adam

    assert adam.fused_adamw_kernel_matches()  # this torch: a change of torch's declaration fails here
    monkeypatch.setattr(adam, "_KERNEL_MATCHES", None)
    monkeypatch.setattr(adam, "_fused_adamw_schemas", lambda: [
        adam.FUSED_ADAMW_SCHEMA.replace("bool maximize,", "bool maximize, float lr_ratio,")])
    half, opt = mixed(backend="fused")
    assert opt._fused_lists is None
    calls = _torch_steps(opt)
    for step in range(3):
        random_grads(half, step, dtype=torch.float16)
        opt.step()
    assert len(calls) == 3
