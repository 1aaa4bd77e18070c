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

On a CPU run the trace has no device events: the device fields are None.
"""

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


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    profiles = {}
    for path in paths:
        with open(path) as fh:
            data = json.load(fh)
        profiles[data.get("name") or path] = data
    print(table(profiles))
    return 0

