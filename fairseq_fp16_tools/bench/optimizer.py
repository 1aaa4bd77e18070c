"""The optimizer step against the memory-bandwidth limit.

    python scripts/bench_optimizer.py [--params 1e6,1e7,1e8] [--device cpu|cuda] [--steps 10]
        [--dtype fp16|bf16]

For each size, in one process and timed in turn (one step of each, round after round, so that
the machine's drift in speed moves them alike): the time of one mixed-precision step of
``fp16_adam`` inside the plugin's wrapper (half grads -> fp32 master grads ->
norm/overflow check -> fused AdamW on fp32 masters -> half copy back), of the
same step compiled (``--compile-step``: the norm summed from the half grads, then
one compiled loop a tensor; its compile time apart), of torch's
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
alone on the same tensors (``passes_ms``), and the compiled step's two parts
(``compiled_passes_ms``): the norm from the half gradients, and the update loops; the passes
of each step timed in turn.

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
from .run_stats import machine

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


def timed_in_turn(fns, steps, device):
    """The median ms of each of ``fns`` (name -> function), called in turn ``steps`` rounds after
    one warm-up call each: a VM's speed can move by half within minutes, and timed in turn the
    ratios between the functions do not move with it."""
    for fn in fns.values():
        fn()
    sync(device)
    times = {name: [] for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def tensors(n, dtype, device, fill=None):
    sizes = [CHUNK] * (n // CHUNK) + ([n % CHUNK] if n % CHUNK else [])
    out = []
    for s in sizes:
        t = torch.empty(s, dtype=dtype, device=device)
        t.normal_() if fill is None else t.fill_(fill)
        out.append(t)
    return out


def wrapper_step(half, grads, device, compile_step=False):
    """One step of the mixed-precision wrapper over ``half`` (half parameters) with ``grads``."""
    scaler = LossScaler(1024.0, scale_window=10**9, device=device)
    opt = MixedPrecisionOptimizer(half, lambda ps: build_adam(ps, lr=1e-4, weight_decay=0.01), scaler,
                                  compile_step=compile_step)

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


def passes(n, device, steps, dtype=torch.float16) -> dict:
    """The wrapper's passes alone on ``n`` parameters, timed in turn."""
    half = tensors(n, dtype, device)
    grads = tensors(n, dtype, device, fill=1e-3)
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

    ms = timed_in_turn({
        "grad_copy": lambda: torch._foreach_copy_([torch.empty_like(m) for m in masters], grads),
        "norm": lambda: torch._foreach_norm(master_grads, 2),
        "adamw": scaled_step,
        "copy_back": lambda: torch._foreach_copy_(half, masters),
    }, steps, device)
    return {"passes_ms": {k: round(v, 3) for k, v in ms.items()}}


def compiled_passes(opt, half, grads, device, steps) -> dict:
    """The compiled step's norm and update alone, timed in turn (``opt`` built with
    ``compile_step``)."""
    for p, g in zip(half, grads):
        p.grad = g
    opt.clip_grad_norm(1.0)
    core = opt._compiled
    out = timed_in_turn({"norm": core.norm,
                         "update": lambda: core.step(opt._inv_scale, opt._found_inf)}, steps, device)
    opt.zero_grad()
    return {k: round(v, 3) for k, v in out.items()}


def bench(n, device, steps, with_passes=True, dtype=torch.float16):
    # mixed precision: half model params with half grads
    half = [torch.nn.Parameter(t) for t in tensors(n, dtype, device)]
    grads = tensors(n, dtype, device, fill=1e-3)
    opt, mixed_step = wrapper_step(half, grads, device)
    step_fns = {"mixed": mixed_step}
    t0 = time.perf_counter()
    try:
        compiled_opt, compiled_step = wrapper_step(half, grads, device, compile_step=True)
    except ValueError as e:  # torch.compile cannot build it here (no compiler, no triton)
        compiled, compiled_opt = {"compiled_error": str(e)}, None
    else:
        compile_s = time.perf_counter() - t0
        step_fns["compiled"] = compiled_step  # its first (warm-up) step is torch's: state made

    # fused fp32 AdamW
    p32 = [torch.nn.Parameter(t) for t in tensors(n, torch.float32, device)]
    g32 = tensors(n, torch.float32, device, fill=1e-3)
    adamw = torch.optim.AdamW(p32, lr=1e-4, weight_decay=0.01, fused=True)

    def adamw_step():
        for p, g in zip(p32, g32):
            p.grad = g
        adamw.step()

    step_fns["adamw"] = adamw_step
    ms = timed_in_turn(step_fns, steps, device)
    mixed_ms, adamw_ms, compiled_ms = ms["mixed"], ms["adamw"], ms.get("compiled")
    del p32, g32, adamw
    with HostSyncCounter() as counter:
        mixed_step()
    syncs = counter.count
    fused = opt.fused_amp
    del opt
    if compiled_opt is not None:
        compiled = {"compiled_step_ms": round(compiled_ms, 3), "compile_s": round(compile_s, 1)}
        if with_passes:
            compiled["compiled_passes_ms"] = compiled_passes(compiled_opt, half, grads, device, steps)
        del compiled_opt
    del half, grads

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
        **compiled,
        "compiled_over_adamw": round(compiled_ms / adamw_ms, 3) if compiled_ms else None,
        **(passes(n, device, steps, dtype) if with_passes else {}),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="1e6,1e7,1e8", help="comma-separated sizes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16",
                    help="the model's half dtype (bf16 on a CPU with bf16 units)")
    ap.add_argument("--no-passes", dest="passes", action="store_false",
                    help="skip the passes alone and the compiled step's norm and update alone")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    dtype = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    rows = [bench(int(float(s)), device, a.steps, a.passes, dtype) for s in a.params.split(",")]
    fixed = fixed_cost(device, a.steps)
    print(f"{'params':>11} {'wrapper ms':>11} {'GB/s':>7} {'copy GB/s':>10} {'x copy':>7} "
          f"{'syncs':>6} {'AdamW32 ms':>11} {'x copy':>7} {'wrapper/AdamW':>14} {'compiled ms':>12} "
          f"{'compiled/AdamW':>15}")
    for r in rows:
        print(f"{r['params']:>11,} {r['step_ms']:>11.2f} {r['achieved_gbps']:>7.2f} {r['copy_gbps']:>10.2f} "
              f"{r['ratio_to_copy']:>7.2f} {r['host_syncs_per_step']:>6} {r['fp32_fused_adamw_ms']:>11.2f} "
              f"{r['fp32_adamw_ratio_to_copy']:>7.2f} {r['wrapper_over_adamw']:>14.2f} "
              + (f"{r['compiled_step_ms']:>12.2f} {r['compiled_over_adamw']:>15.2f}" if r["compiled_over_adamw"]
                 else f"  compiled: {r['compiled_error']}"))
    for r in rows:
        if "passes_ms" in r:
            c = r.get("compiled_passes_ms")
            print(f"{r['params']:>11,} passes alone, ms: " + ", ".join(
                f"{k} {v:.2f}" for k, v in r["passes_ms"].items())
                + (f"; compiled: norm {c['norm']:.2f}, update {c['update']:.2f} (compiled in "
                   f"{r['compile_s']:.0f} s)" if c else ""))
    print(f"fixed cost: {fixed['step_ms']:.3f} ms a step over {fixed['tensors']} tensors of "
          f"{fixed['params'] // fixed['tensors']} parameters, {fixed['launches']:.0f} kernel launches"
          + (f"; {fixed['torch_step_ms']:.3f} ms through torch's AdamW.step" if "torch_step_ms" in fixed else ""))
    print(json.dumps({"device": str(device), "torch": torch.__version__, "dtype": a.dtype,
                      "threads": torch.get_num_threads(), "results": rows, "fixed": fixed,
                      "machine": machine(["--cpu"] if device.type == "cpu" else []),
                      "provenance": describe()}))

