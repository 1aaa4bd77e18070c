"""The optimizer step against the memory-bandwidth limit.

    python scripts/bench_optimizer.py [--params 1e6,1e7,1e8] [--device cpu|cuda] [--steps 10]

For each size, in one process: the time of one mixed-precision step of
``fp16_adam`` inside the plugin's wrapper (fp16 grads -> norm/overflow check ->
fp32 master grads -> fused AdamW on fp32 masters -> fp16 copy back), of torch's
fused ``AdamW`` on fp32 parameters, and of a plain memory copy; the bytes each
step must move, the achieved GB/s and its ratio to the copy bandwidth; and the
host syncs one wrapper step makes (counted with HostSyncCounter). Then the fixed cost: the
same step on a transformer's count of tiny tensors (200 of 16 parameters), where the time is
the host's launches and the kernels' latency, not bandwidth, and the kernels it launches
(counted with OpCensus).

Bytes per parameter: wrapper 44 (grad copy fp16 -> fp32 2+4; norm reads the
fp32 grads 4; fused AdamW reads param/grad/m/v 16 and writes param/m/v 12;
copy back 4+2); fused fp32 AdamW 28. The copy moves the wrapper's bytes (half
read, half written) in fp32.

What bounds the step (``--passes``, on by default): each of the wrapper's four passes timed
alone on the same tensors (``passes_ms``), and ``one_pass``: the whole update of a tensor (the
half gradient unscaled, the moments, the fp32 master, its half copy, skipped on overflow) as
one ``torch.compile``'d loop over 30 bytes a parameter (the norm over the half gradients adds
2), called once per tensor: its compile time, its time at each size and its host time a call,
measured on the tiny tensors of the fixed cost. torch has no eager kernel that takes half
gradients into fp32 weights or writes a half copy.

Prints a table and, as its last line, one JSON object (with the ``provenance`` of the code and
software measured: fairseq_fp16_tools/provenance.py).
"""

import argparse
import json
import statistics
import time

import torch

from fairseq_fp16.core.adam import build_adam
from fairseq_fp16.core.host_sync import HostSyncCounter
from fairseq_fp16.core.loss_scaler import LossScaler
from fairseq_fp16.core.master_weights import MixedPrecisionOptimizer

from ..provenance import describe
from .op_census import OpCensus

CHUNK = 1 << 20  # parameters per tensor (a transformer has many mid-sized tensors)
WRAPPER_BYTES_PER_PARAM = 44
ADAMW_BYTES_PER_PARAM = 28


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, steps, device):
    fn()  # warm-up (allocates state)
    sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def tensors(n, dtype, device, fill=None):
    sizes = [CHUNK] * (n // CHUNK) + ([n % CHUNK] if n % CHUNK else [])
    out = []
    for s in sizes:
        t = torch.empty(s, dtype=dtype, device=device)
        t.normal_() if fill is None else t.fill_(fill)
        out.append(t)
    return out


def wrapper_step(half, grads, device):
    """One step of the mixed-precision wrapper over ``half`` (fp16 parameters) with ``grads``."""
    scaler = LossScaler(1024.0, scale_window=10**9, device=device)
    opt = MixedPrecisionOptimizer(half, lambda ps: build_adam(ps, lr=1e-4, weight_decay=0.01), scaler)

    def mixed_step():
        opt.zero_grad()  # as fairseq does before each forward: the fp32 master grads are freed
        for p, g in zip(half, grads):
            p.grad = g  # arrives from backward; not timed as optimizer work
        opt.clip_grad_norm(1.0)
        opt.step()

    return opt, mixed_step


def fixed_cost(device, steps, count=200, size=16):
    """ms and kernel launches of a wrapper step over ``count`` tensors of ``size`` parameters;
    ``torch_step_ms``: the same step through ``torch.optim.AdamW.step``, which walks the
    parameters in Python each call (the wrapper steps torch's fused kernel on lists built once)."""
    half = [torch.nn.Parameter(torch.randn(size, device=device).half()) for _ in range(count)]
    grads = [torch.full((size,), 1e-3, dtype=torch.float16, device=device) for _ in range(count)]
    opt, mixed_step = wrapper_step(half, grads, device)
    ms = timed(mixed_step, max(steps, 50), device)
    with OpCensus() as census:
        mixed_step()
    out = {"tensors": count, "params": count * size, "step_ms": round(ms, 3),
           "launches": census.summary(1)["launches"]}
    if opt._fused_lists is not None:
        opt._fused_lists = None
        out["torch_step_ms"] = round(timed(mixed_step, max(steps, 50), device), 3)
    return out


def _adamw_one_pass(master, grad, exp_avg, exp_avg_sq, half, hyper):
    """One tensor's mixed-precision AdamW update in one loop. ``hyper``: lr, beta1, beta2, the
    decay factor ``1 - lr * weight_decay``, ``lr / bias_correction1``,
    ``sqrt(bias_correction2)``, eps, the unscale factor and the overflow flag (one tensor, so
    that a new step recompiles nothing)."""
    g = grad.float() * hyper[7]
    m = exp_avg * hyper[1] + g * (1 - hyper[1])
    v = exp_avg_sq * hyper[2] + g * g * (1 - hyper[2])
    p = master * hyper[3] - hyper[4] * m / (v.sqrt() / hyper[5] + hyper[6])
    skip = hyper[8] > 0
    p, m, v = torch.where(skip, master, p), torch.where(skip, exp_avg, m), torch.where(skip, exp_avg_sq, v)
    master.copy_(p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    half.copy_(p)


def passes(n, device, steps) -> dict:
    """The wrapper's passes alone, and the compiled one-pass update, on ``n`` parameters."""
    half = tensors(n, torch.float16, device)
    grads = tensors(n, torch.float16, device, fill=1e-3)
    masters = [torch.nn.Parameter(t.float()) for t in half]
    adamw = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.01, fused=True)
    for m, g in zip(masters, grads):
        m.grad = g.float()
    adamw.step()  # the moments exist
    master_grads = [m.grad for m in masters]
    scale, found_inf = torch.tensor(1024.0, device=device), torch.zeros((), device=device)

    def scaled_step():
        adamw.grad_scale, adamw.found_inf = scale, found_inf
        adamw.step()

    ms = {
        "grad_copy": timed(lambda: torch._foreach_copy_([torch.empty_like(m) for m in masters], grads),
                           steps, device),
        "norm": timed(lambda: torch._foreach_norm(master_grads, 2), steps, device),
        "adamw": timed(scaled_step, steps, device),
        "copy_back": timed(lambda: torch._foreach_copy_(half, masters), steps, device),
    }
    out = {"passes_ms": {k: round(v, 3) for k, v in ms.items()}}
    states = [adamw.state[m] for m in masters]
    hyper = torch.tensor([1e-4, 0.9, 0.999, 1 - 1e-6, 1e-3, 0.03, 1e-8, 1 / 1024, 0.0], device=device)
    try:
        t0 = time.perf_counter()
        kernel = torch.compile(_adamw_one_pass, dynamic=True)
        kernel(masters[0].detach(), grads[0], states[0]["exp_avg"], states[0]["exp_avg_sq"], half[0], hyper)
        sync(device)
        compile_s = time.perf_counter() - t0
    except Exception as e:  # no C++ compiler, no triton
        out["one_pass"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        return out

    def one_pass():
        for m, g, st, h in zip(masters, grads, states, half):
            kernel(m.detach(), g, st["exp_avg"], st["exp_avg_sq"], h, hyper)

    out["one_pass"] = {"compile_s": round(compile_s, 1), "ms": round(timed(one_pass, steps, device), 3),
                       "norm_half_ms": round(timed(lambda: torch._foreach_norm(grads, 2), steps, device), 3)}
    tiny = [(torch.randn(16, device=device), torch.randn(16, device=device).half(), torch.zeros(16, device=device),
             torch.zeros(16, device=device), torch.zeros(16, device=device).half()) for _ in range(200)]
    calls = timed(lambda: [kernel(*t, hyper) for t in tiny], steps, device)
    out["one_pass"]["host_us_a_call"] = round(calls * 1000 / len(tiny), 1)
    return out


def bench(n, device, steps, with_passes=True):
    # mixed precision: fp16 model params with fp16 grads
    half = [torch.nn.Parameter(t) for t in tensors(n, torch.float16, device)]
    grads = tensors(n, torch.float16, device, fill=1e-3)
    opt, mixed_step = wrapper_step(half, grads, device)
    mixed_ms = timed(mixed_step, steps, device)
    with HostSyncCounter() as counter:
        mixed_step()
    syncs = counter.count
    fused = opt.fused_amp
    del half, grads, opt

    # fused fp32 AdamW
    p32 = [torch.nn.Parameter(t) for t in tensors(n, torch.float32, device)]
    g32 = tensors(n, torch.float32, device, fill=1e-3)
    adamw = torch.optim.AdamW(p32, lr=1e-4, weight_decay=0.01, fused=True)

    def adamw_step():
        for p, g in zip(p32, g32):
            p.grad = g
        adamw.step()

    adamw_ms = timed(adamw_step, steps, device)
    del p32, g32, adamw

    # memory copy: the wrapper's bytes as one read+write stream
    src = torch.empty(n * WRAPPER_BYTES_PER_PARAM // 8, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy_ms = timed(lambda: dst.copy_(src), steps, device)
    copy_gbps = 2 * src.numel() * 4 / copy_ms / 1e6
    del src, dst

    achieved = n * WRAPPER_BYTES_PER_PARAM / mixed_ms / 1e6
    adamw_gbps = n * ADAMW_BYTES_PER_PARAM / adamw_ms / 1e6
    return {
        "params": n,
        "step_ms": round(mixed_ms, 3),
        "achieved_gbps": round(achieved, 2),
        "copy_gbps": round(copy_gbps, 2),
        "ratio_to_copy": round(achieved / copy_gbps, 3),
        "host_syncs_per_step": syncs,
        "fused_kernel": fused,
        "fp32_fused_adamw_ms": round(adamw_ms, 3),
        "fp32_fused_adamw_gbps": round(adamw_gbps, 2),
        "fp32_adamw_ratio_to_copy": round(adamw_gbps / copy_gbps, 3),
        "wrapper_over_adamw": round(mixed_ms / adamw_ms, 3),
        **(passes(n, device, steps) if with_passes else {}),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="1e6,1e7,1e8", help="comma-separated sizes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-passes", dest="passes", action="store_false",
                    help="skip the passes alone and the compiled one-pass update")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    rows = [bench(int(float(s)), device, a.steps, a.passes) for s in a.params.split(",")]
    fixed = fixed_cost(device, a.steps)
    print(f"{'params':>11} {'wrapper ms':>11} {'GB/s':>7} {'copy GB/s':>10} {'x copy':>7} "
          f"{'syncs':>6} {'AdamW32 ms':>11} {'x copy':>7} {'wrapper/AdamW':>14}")
    for r in rows:
        print(f"{r['params']:>11,} {r['step_ms']:>11.2f} {r['achieved_gbps']:>7.2f} {r['copy_gbps']:>10.2f} "
              f"{r['ratio_to_copy']:>7.2f} {r['host_syncs_per_step']:>6} {r['fp32_fused_adamw_ms']:>11.2f} "
              f"{r['fp32_adamw_ratio_to_copy']:>7.2f} {r['wrapper_over_adamw']:>14.2f}")
    for r in rows:
        if "passes_ms" in r:
            one = r["one_pass"]
            print(f"{r['params']:>11,} passes alone, ms: " + ", ".join(
                f"{k} {v:.2f}" for k, v in r["passes_ms"].items()) + "; compiled one pass: " + (
                one["error"] if "error" in one else
                f"{one['ms']:.2f} ms + half norm {one['norm_half_ms']:.2f} ms, "
                f"{one['host_us_a_call']:.0f} us a call, compiled in {one['compile_s']:.0f} s"))
    print(f"fixed cost: {fixed['step_ms']:.3f} ms a step over {fixed['tensors']} tensors of "
          f"{fixed['params'] // fixed['tensors']} parameters, {fixed['launches']:.0f} kernel launches"
          + (f"; {fixed['torch_step_ms']:.3f} ms through torch's AdamW.step" if "torch_step_ms" in fixed else ""))
    print(json.dumps({"device": str(device), "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "results": rows, "fixed": fixed,
                      "provenance": describe()}))

