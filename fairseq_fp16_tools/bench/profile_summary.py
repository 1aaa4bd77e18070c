"""Where an update's time goes: a torch.profiler trace of a few updates, summarised.

    python scripts/profile_summary.py PROFILE.json [PROFILE.json ...]   # prints the table

:func:`summarize_trace` turns the Chrome trace that ``torch.profiler`` exports (written by
``scripts/run_stats.py --profile-updates``) into a small JSON record per run:

* ``wall_ms``: wall time per update over the profiled window (loader, logging and host
  syncs included);
* ``gpu_busy_ms`` and ``gpu_idle_frac``: the union of the device's kernel, copy and set
  intervals per update, and the fraction of the window in which the device ran nothing;
* ``kernel_ms``: device time per update by kernel class (:data:`CLASSES`, first match wins);
* ``launches``: kernel launches per update; ``host_sync_ms``: host time per update spent
  waiting in ``cuda*Synchronize`` calls; ``host_ms``: the rest of the wall time, the host's
  own work;
* ``outside_step_ms``: wall time per update outside ``Trainer.train_step`` (waiting for the
  next batch, logging);
* ``top_kernels``: the :data:`TOP` device kernels taking the most time, each
  ``[name (first 120 characters), launches per update, ms per update]``;
  ``top_host_ops``: the :data:`TOP` most frequent host operators (``aten::...``), each
  ``[name, calls per update, host ms per update]``: what to fuse or drop first.

On a CPU run the trace has no device events: the device fields are None, and ``cpu_ms`` says
where the CPU's time goes instead: each operator's self time (its time less that of the
operators it called) per update, by :func:`cpu_class` (:data:`CPU_CLASSES`), with
``framework`` the rest of the train steps' wall time (Python, dispatch, the profiler's own
cost); ``products_frac``: the products' share of the train steps' wall time;
``copies_by_asker``: the copies' self time by what asked for them, the nearest enclosing event
that is not itself a copy, a view or a cast (``aten::bmm``: a product making its operands
contiguous; ``ViewBackward0``: autograd reshaping a gradient; ``optimizer``: the step), each
``[asker, copies per update (a copy's own inner copies not counted), ms per update]``.
"""

import argparse
import json
import re
import sys
from typing import Dict, Iterable, List, Optional, Tuple

#: Kernel classes by name, tried in order; the last one takes the rest.
CLASSES: List[Tuple[str, str]] = [
    ("optimizer", r"adam|multi_tensor_apply|foreach|l2norm|unscale|non_finite"),
    ("attention", r"flash|fmha|attention|mem_eff"),
    ("matmul", r"gemm|xmma|cutlass|nvjet|cublas|sm\d\d_|wgmma|splitk|triton_tem"),
    ("softmax/norm", r"softmax|norm|cross_entropy|nll_loss"),
    ("copies", r"memcpy|memset|copy|cat_|catarray|fill|to_copy"),
    ("elementwise/other", r""),
]
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
#: CPU time classes (:func:`cpu_class`), in the order of the table's columns
CPU_CLASSES = ("products", "copies", "dropout", "norm/softmax", "elementwise", "loss", "step",
               "framework")
#: fairseq's trainer's ranges around the optimizer's work (``record_function``)
STEP_RANGES = {"reduce-grads", "multiply-grads", "clip-grads", "optimizer"}
#: the loss: fairseq's log-softmax and NLL and their backward, the plugin's fused loss
LOSS = re.compile(r"log_softmax|logsoftmax|nll_loss|nllloss|cross_entropy|_cachechunks|"
                  r"_streamchunks|_compiledchunks")
DROPOUT = re.compile(r"bernoulli|dropout")
PRODUCTS = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|addbmm|mv|addmv|dot|convolution|"
                      r"_convolution|mkldnn_\w+|_scaled_dot_product\w*|conv_tbc\w*)$"
                      r"|^mkldnn::_linear_pointwise$")  # oneDNN's linear (the CPU half layers' bias)
COPIES = re.compile(r"^aten::(copy_|_to_copy|clone|contiguous|cat|stack|_foreach_copy_|"
                    r"index_select|embedding\w*|fill_|zero_|_unsafe_view)$")
#: operators that only pass a copy on to the one that asked for it (:func:`cpu_breakdown`)
PASS_ON = re.compile(r"^aten::(reshape|view|to|type_as|_reshape_alias|flatten|expand_as)$")
NORMS = re.compile(r"^aten::(native_layer_norm\w*|_softmax\w*|softmax|native_group_norm\w*|"
                   r"_fused_rms_norm\w*|native_batch_norm\w*)$")
TOP = 15
LAUNCH = re.compile(r"^(cuda|cu)LaunchKernel|^cudaLaunchCooperativeKernel|^cuLaunchKernelEx")
SYNC = re.compile(r"^cuda(Stream|Device|Event)Synchronize$")


def classify(name: str, cat: str) -> str:
    low = name.lower()
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "copies"
    for label, pattern in CLASSES:
        if re.search(pattern, low):
            return label
    return CLASSES[-1][0]


def _union_ms(intervals: Iterable[Tuple[float, float]]) -> float:
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1000.0


def summarize_trace(trace: Dict, updates: int, window_ms: float,
                    step_ms: Optional[List[float]] = None) -> Dict:
    """The summary of one profiled window of ``updates`` updates lasting ``window_ms``.

    ``trace`` is the exported Chrome trace (``{"traceEvents": [...]}``); ``step_ms`` the wall
    times of the ``Trainer.train_step`` calls inside the window.
    """
    if updates < 1 or window_ms <= 0:
        raise ValueError(f"a profile needs updates >= 1 and a window > 0 ms, got {updates}, {window_ms}")
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    by_class: Dict[str, float] = {}
    for e in device:
        label = classify(e.get("name", ""), e.get("cat", ""))
        by_class[label] = by_class.get(label, 0.0) + e["dur"] / 1000.0
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    cpu_ms, products_frac, top_self, copies = None, None, None, None
    if not device and step_ms:
        cpu_ms, top_self, copies = cpu_breakdown(events, updates, sum(step_ms) / updates)
        products_frac = round(cpu_ms["products"] / (sum(step_ms) / updates), 4)
    launches = sum(1 for e in runtime if LAUNCH.search(e.get("name", "")))
    sync_ms = sum(e["dur"] for e in runtime if SYNC.search(e.get("name", ""))) / 1000.0
    wall = window_ms / updates
    out = {
        "updates": updates,
        "wall_ms": round(wall, 3),
        "host_sync_ms": round(sync_ms / updates, 3) if runtime else None,
        "host_ms": round(wall - sync_ms / updates, 3) if runtime else None,
        "launches": round(launches / updates, 1) if runtime else None,
        "outside_step_ms": (round(wall - sum(step_ms) / updates, 3) if step_ms else None),
        "gpu_busy_ms": None,
        "gpu_idle_frac": None,
        "kernel_ms": None,
        "cpu_ms": cpu_ms,
        "products_frac": products_frac,
        "top_cpu_self": top_self,
        "copies_by_asker": copies,
        "device_kernels": len(device) // updates,
        "top_kernels": _top(device, updates, key=2),
        "top_host_ops": _top([e for e in events if e.get("cat") == "cpu_op"
                              and e.get("name", "").startswith("aten::")], updates, key=1),
    }
    if device:
        busy = _union_ms((e["ts"], e["ts"] + e["dur"]) for e in device) / updates
        out["gpu_busy_ms"] = round(busy, 3)
        out["gpu_idle_frac"] = round(max(0.0, 1.0 - busy / wall), 4)
        out["kernel_ms"] = {k: round(by_class.get(k, 0.0) / updates, 3) for k, _ in CLASSES}
    return out


def cpu_class(name: str, ranges: Iterable[str]) -> str:
    """The class of a CPU operator ``name`` run inside the ranges ``ranges`` (the names of the
    events enclosing it: fairseq's ``record_function`` ranges, autograd's backward nodes, custom
    functions): the step (inside the trainer's optimizer ranges), the loss or dropout (by the
    operator's or an enclosing range's name), else by the operator: products, copies and
    casts, norms and softmax, the rest elementwise."""
    ranges = list(ranges)
    if STEP_RANGES.intersection(ranges):
        return "step"
    names = [name.lower()] + [r.lower() for r in ranges]
    if any(LOSS.search(n) for n in names):
        return "loss"
    if any(DROPOUT.search(n) for n in names):
        return "dropout"
    for label, pattern in (("products", PRODUCTS), ("copies", COPIES), ("norm/softmax", NORMS)):
        if pattern.match(name):
            return label
    return "elementwise"


def cpu_breakdown(events: List[Dict], updates: int, step_wall_ms: float):
    """(ms per update by :data:`CPU_CLASSES` of the CPU operators' self times, with
    ``framework`` the train steps' wall time per update ``step_wall_ms`` less all of them;
    the :data:`TOP` (class, operator) pairs by self time, each ``[class, name, calls per update,
    ms per update]``; the :data:`TOP` askers of the copies by self time, each ``[asker, copies
    per update, ms per update]``)."""
    spans = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    spans.sort(key=lambda e: (e.get("tid", 0), e["ts"], -e["dur"]))
    totals = {k: 0.0 for k in CPU_CLASSES}
    by_op: Dict[Tuple[str, str], List[float]] = {}
    askers: Dict[str, List[float]] = {}
    stack: List[List] = []  # [event, time of its children], the enclosing events
    tid = None

    def close(item):
        event, children = item
        if event.get("cat") == "cpu_op":
            name = event.get("name", "")
            label = cpu_class(name, (e.get("name", "") for e, _ in stack))
            own = max(0.0, event["dur"] - children)
            totals[label] += own
            acc = by_op.setdefault((label, name[:120]), [0, 0.0])
            acc[0] += 1
            acc[1] += own
            if COPIES.match(name):
                asker = next((n for n in (e.get("name", "") for e, _ in reversed(stack))
                              if not COPIES.match(n) and not PASS_ON.match(n)), "(none)")
                acc = askers.setdefault(asker[:120], [0, 0.0])
                acc[0] += not (stack and COPIES.match(stack[-1][0].get("name", "")))  # outermost
                acc[1] += own

    for e in spans:
        if e.get("tid", 0) != tid:
            while stack:
                close(stack.pop())
            tid = e.get("tid", 0)
        while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
            close(stack.pop())
        if stack:
            stack[-1][1] += e["dur"]
        stack.append([e, 0.0])
    while stack:
        close(stack.pop())
    out = {k: round(v / 1000.0 / updates, 3) for k, v in totals.items()}
    out["framework"] = round(max(0.0, step_wall_ms - sum(out.values())), 3)
    top = sorted(by_op.items(), key=lambda kv: -kv[1][1])[:TOP]
    copies = sorted(askers.items(), key=lambda kv: -kv[1][1])[:TOP]
    return (out, [[label, name, round(n / updates, 1), round(us / 1000.0 / updates, 3)]
                  for (label, name), (n, us) in top],
            [[asker, round(n / updates, 1), round(us / 1000.0 / updates, 3)] for asker, (n, us) in copies])


def _top(events, updates: int, key: int) -> List[list]:
    """``[name, count per update, ms per update]`` of the :data:`TOP` names with the most
    time (``key=2``) or calls (``key=1``)."""
    by_name: Dict[str, List[float]] = {}
    for e in events:
        acc = by_name.setdefault(e.get("name", "")[:120], [0, 0.0])
        acc[0] += 1
        acc[1] += e["dur"] / 1000.0
    rows = [[name, round(n / updates, 1), round(ms / updates, 3)] for name, (n, ms) in by_name.items()]
    return sorted(rows, key=lambda r: -r[key])[:TOP]


def table(profiles: Dict[str, Dict]) -> str:
    """One line per run: wall, device busy and idle, host, syncs, launches, time by class."""
    classes = [k for k, _ in CLASSES]
    head = (f"{'run':22s} {'wall ms':>8s} {'busy ms':>8s} {'idle':>6s} {'host ms':>8s} "
            f"{'sync ms':>8s} {'out ms':>7s} {'launch':>7s}  " + "  ".join(f"{c:>10.10s}" for c in classes))
    lines = [head]

    def f(v, fmt):
        return format(v, fmt) if v is not None else "-".rjust(len(format(0, fmt)))

    for name, p in profiles.items():
        if "error" in p:
            lines.append(f"{name:22s} profile failed: {p['error']}")
            continue
        k = p.get("kernel_ms") or {}
        lines.append(
            f"{name:22s} {f(p['wall_ms'], '8.1f')} {f(p['gpu_busy_ms'], '8.1f')} "
            f"{f(p['gpu_idle_frac'], '6.2f')} {f(p['host_ms'], '8.1f')} {f(p['host_sync_ms'], '8.1f')} "
            f"{f(p['outside_step_ms'], '7.1f')} {f(p['launches'], '7.0f')}  "
            + "  ".join(f(k.get(c), '10.2f') for c in classes))
    return "\n".join(lines)


def cpu_table(profiles: Dict[str, Dict]) -> str:
    """One line per CPU run: ms per update by :data:`CPU_CLASSES` and the products' share."""
    head = f"{'run':22s} {'wall ms':>8s} " + " ".join(f"{c:>12.12s}" for c in CPU_CLASSES) + "  products"
    lines = [head]
    for name, p in profiles.items():
        cpu = p.get("cpu_ms")
        if cpu:
            lines.append(f"{name:22s} {p['wall_ms']:8.1f} " + " ".join(f"{cpu[c]:12.1f}" for c in CPU_CLASSES)
                         + f"  {p['products_frac']:8.0%}")
    return "\n".join(lines) if len(lines) > 1 else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("profiles", nargs="+", metavar="PROFILE.json",
                    help="summaries written by scripts/run_stats.py --profile-updates")
    profiles = {}
    for path in ap.parse_args(argv).profiles:
        with open(path) as fh:
            data = json.load(fh)
        profiles[data.get("name") or path] = data
    print(table(profiles))
    cpu = cpu_table(profiles)
    if cpu:
        print("\nCPU time per update (ms, operators' self time):\n" + cpu)
    for name, p in profiles.items():
        if p.get("copies_by_asker"):
            print(f"\n{name}: copies by what asked for them (per update: copies, ms):\n" + "\n".join(
                f"{n:8.1f} {ms:8.1f}  {asker}" for asker, n, ms in p["copies_by_asker"]))
    return 0

