"""What an update asks of the device, counted on any machine: operators, bytes, host syncs.

On a fast GPU a transformer update is bound by the host, which launches one kernel per
operator from Python, and by the memory traffic of the elementwise work; neither needs a GPU to
count. :class:`OpCensus` is a ``TorchDispatchMode`` that sees every operator after autograd, as
the device would receive it, and counts per operator:

* launches: operators that run a kernel (views, allocations and ``detach`` do not); a
  multi-tensor ``_foreach_*`` operator one, or one a tensor where torch's CUDA backend
  would take its slow path (:func:`foreach_launches`);
* bytes: every tensor argument read once and every output written once (an in-place
  operator reads and writes its tensor; ``copy_`` reads the source and writes the
  destination; a gather, scatter or index_select touches its index's elements and rows, not
  the whole tensor): the traffic of an operator that streams its operands, which the
  elementwise and copy kernels of an update do;
* host syncs: operators that make the host wait for the device (``.item()``,
  ``nonzero``, ``torch.equal``), also by phase and by the line of Python outside torch that
  asked (``sync_sites``). A sync drains the device's queue, so the host cannot run ahead of it
  there. A CPU run cannot tell which tensors a CUDA run keeps on the host, so scalar reads of
  those count too (fairseq's sinusoidal positions read their input's shape as a tensor: no
  wait on CUDA).

Operators are grouped by class (the kernel classes of :mod:`.profile_summary`) and by phase:
``backward`` (run by the autograd engine), ``step`` (inside the optimizer's ``step``) and
``forward`` (everything else in ``Trainer.train_step``: forward, loss, loss scaling, clipping).
A composite operator that torch runs as several kernels (``logsumexp``) counts once, and a CPU
run sees the CPU's decomposition (a half-to-fp32 ``log_softmax`` is one kernel on CUDA, a cast
and a ``log_softmax`` here), so the counts are a close proxy for the GPU's, not its trace.

On a CPU without half-precision units torch's half matrix products crawl; the census
runs them as fp32 products rounded to half (what a GPU's tensor cores compute), counted as
the half products they replace.

``scripts/run_stats.py --census-updates FIRST:COUNT CENSUS.json`` takes the census of COUNT
steady-state updates of a ``fairseq-train`` run from update FIRST on;
``scripts/op_census.py`` compares modes, counting every update from FIRST on by kind (applied,
skipped for overflow, and either with the non-finite watch armed: :class:`UpdatesByKind`)
until COUNT have applied; its JSON records the ``provenance`` of the code and software
counted (fairseq_fp16_tools/provenance.py).
"""

import argparse
import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fairseq_fp16.core.diagnostics import is_dense

from ..paths import ROOT
from ..provenance import describe
from .fairseq_train import ENV, MODEL, MODES, STOCK, parse_modes, plugin_args
from .windows import UpdateWindow

__all__ = ["CLASSES", "KINDS", "OpCensus", "UpdatesByKind", "census_worker", "classify_op", "diff_table",
           "foreach_launches", "run_census", "table"]

#: operator classes by aten name, tried in order; the last takes the rest
CLASSES: List[Tuple[str, str]] = [
    ("optimizer", r"^_foreach_|^_fused_adam|^_amp_"),
    ("attention", r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention"),
    # _linear_pointwise: oneDNN's linear, the CPU half layers' bias in the product (CUDA: addmm)
    ("matmul", r"^(mm|addmm|bmm|baddbmm|addbmm|_addmm_activation|addmv|mv|dot|_linear_pointwise)$"),
    ("softmax/norm", r"softmax|layer_norm|group_norm|batch_norm|logsumexp|nll_loss|cross_entropy"),
    ("copies", r"^(_to_copy|copy_|fill_|zero_|cat|clone|zeros|zeros_like|ones|ones_like|full|"
               r"full_like|new_zeros|new_ones|new_full|scalar_tensor|_copy_from|index_copy_?)$"),
    ("elementwise/other", r""),
]
#: operators that launch no kernel besides views
NO_KERNEL = {"_unsafe_view", "_record_function_enter_new", "_record_function_exit", "empty",
             "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
             "lift_fresh", "alias", "resize_", "set_", "_local_scalar_dense", "is_same_size",
             "_has_compatible_shallow_copy_type"}
#: operators that make the host wait for the device
SYNCS = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "_unique2",
         "unique_consecutive", "unique_dim"}
PHASES = ("forward", "backward", "step")
#: operators that touch only the elements (gather, scatter) or rows (index_select,
#: embedding) their index names
INDEXED = {"gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "index_select",
           "embedding"}


#: norm orders torch's CUDA ``_foreach_norm`` runs as one multi-tensor launch (order 0 joined
#: them in 2026, pytorch/pytorch#179869, after the H200's torch 2.11: counted one a tensor)
FOREACH_NORM_ORDERS = (1, 2, float("inf"))


def _tensor_lists(args) -> List[List[torch.Tensor]]:
    return [list(a) for a in args if isinstance(a, (list, tuple)) and a
            and all(isinstance(t, torch.Tensor) for t in a)]


def foreach_launches(name: str, args, kwargs) -> int:
    """Kernels of a ``_foreach_*`` operator as torch's CUDA backend runs it: one on its fast
    path, one a tensor on its slow path, which it takes where the lists hold tensors of
    several devices or dtypes (a copy may change the dtype), one that is not dense (a
    slice), tensors of other sizes or strides at the same position of two lists, or, for
    ``_foreach_norm``, an order other than 1, 2 or inf (``ForeachUtils.h``,
    ``ForeachReduceOp.cu``). The CPU runs them one by one anyhow."""
    lists = _tensor_lists(args)
    if not lists:
        return 1
    n = len(lists[0])
    tensors = [t for tl in lists for t in tl]
    slow = (len({t.device for t in tensors}) > 1
            or (name != "_foreach_copy_" and len({t.dtype for t in tensors}) > 1)
            or not all(t.layout == torch.strided and is_dense(t) for t in tensors)
            or any(len(tl) != n or any(a.shape != b.shape or a.stride() != b.stride()
                                       for a, b in zip(lists[0], tl)) for tl in lists[1:]))
    if name == "_foreach_norm":
        order = kwargs.get("ord", args[1] if len(args) > 1 else 2)
        slow = slow or float(order) not in FOREACH_NORM_ORDERS or tensors[0].is_complex()
    return n if slow else 1


def op_name(func) -> str:
    """``aten.add_.Tensor`` -> ``add_``."""
    return func.__name__.split(".")[0]


def classify_op(name: str) -> str:
    for label, pattern in CLASSES:
        if re.search(pattern, name):
            return label
    return CLASSES[-1][0]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _indexed_bytes(name: str, args, out) -> int:
    """Read the index and the elements or rows it names, write as many (or the output)."""
    if name in ("index_select", "embedding"):
        index = args[2] if name == "index_select" else args[1]
        return _nbytes([index]) + 2 * _nbytes(tree_flatten(out)[0])
    self, index = args[0], args[2]
    return _nbytes([index]) + 2 * index.numel() * self.element_size()


_HALF = (torch.float16, torch.bfloat16)
_MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_MODE_HOOKS = ("__torch_function__", "__torch_dispatch__")


def _caller() -> str:
    """``path:line (function)`` of the innermost frame outside torch, this module and any
    torch function or dispatch mode: the Python that asked for a sync (the path from the
    repository or from site-packages)."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                 or frame.f_code.co_filename == __file__
                                 or frame.f_code.co_name in _MODE_HOOKS):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    if "site-packages" + os.sep in path:
        path = path.split("site-packages" + os.sep, 1)[1]
    elif path.startswith(str(ROOT) + os.sep):
        path = path[len(str(ROOT)) + 1:]
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"


def _fp32_product(func, args, kwargs):
    """A half matrix product on the CPU as an fp32 product rounded to half (fast anywhere)."""
    up = [a.float() if isinstance(a, torch.Tensor) and a.dtype in _HALF else a for a in args]
    return func(*up, **kwargs).to(args[-1].dtype)


class OpCensus(TorchDispatchMode):
    """Counts the operators run inside it (see the module's docstring).

    ``phase`` is ``forward`` unless the autograd engine runs the operator (``backward``) or
    :attr:`in_step` is set (``step``, by the caller around the optimizer's step).
    ``fp32_products``: CPU half matrix products run as fp32 products rounded to half.
    """

    def __init__(self, fp32_products: bool = False) -> None:
        super().__init__()
        self.fp32_products = fp32_products
        self.in_step = False
        #: False: operators run (fp32 products included) but are not counted
        self.counting = True
        # (op, phase) -> [launches, bytes]; syncs by op and by (phase, caller)
        self.ops: Dict[Tuple[str, str], List[int]] = defaultdict(lambda: [0, 0])
        self.syncs: Dict[str, int] = defaultdict(int)
        self.sync_sites: Dict[Tuple[str, str], int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        if (self.fp32_products and name in _MATMULS and "out" not in kwargs
                and args[-1].dtype in _HALF and args[-1].device.type == "cpu"):
            out = _fp32_product(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if not self.counting:
            return out
        if torch._C._current_autograd_node() is not None:
            phase = "backward"
        else:
            phase = "step" if self.in_step else "forward"
        if name in SYNCS:
            self.syncs[name] += 1
            self.sync_sites[(phase, _caller())] += 1
        if func.is_view or name in NO_KERNEL:
            return out
        if name == "copy_":
            moved = _nbytes(args[1:2]) + _nbytes(args[:1])
        elif name in INDEXED:
            moved = _indexed_bytes(name, args, out)
        else:
            ins = tree_flatten((args, {k: v for k, v in kwargs.items() if k != "out"}))[0]
            moved = _nbytes(ins) + _nbytes(tree_flatten(out)[0])
        entry = self.ops[(name, phase)]
        entry[0] += foreach_launches(name, args, kwargs) if name.startswith("_foreach_") else 1
        entry[1] += moved
        return out

    def merge(self, other: "OpCensus") -> None:
        """Add ``other``'s counts to these."""
        for key, (n, b) in other.ops.items():
            entry = self.ops[key]
            entry[0] += n
            entry[1] += b
        for name, n in other.syncs.items():
            self.syncs[name] += n
        for site, n in other.sync_sites.items():
            self.sync_sites[site] += n

    def summary(self, updates: int) -> Dict:
        """Per update: launches, MB moved and syncs in all, by class, by phase and by operator
        (``ops``: name -> [launches, MB], largest MB first); ``sync_sites``: "phase caller" ->
        syncs, most first."""
        if updates < 1:
            raise ValueError(f"a census needs updates >= 1, got {updates}")
        by_op: Dict[str, List[int]] = defaultdict(lambda: [0, 0])
        by_class: Dict[str, List[int]] = {k: [0, 0] for k, _ in CLASSES}
        by_phase: Dict[str, List[int]] = {k: [0, 0] for k in PHASES}
        for (name, phase), (n, b) in self.ops.items():
            for acc in (by_op[name], by_class[classify_op(name)], by_phase[phase]):
                acc[0] += n
                acc[1] += b

        def rec(n, b):
            return {"launches": round(n / updates, 1), "mb": round(b / updates / 2**20, 2)}

        launches = sum(v[0] for v in by_op.values())
        moved = sum(v[1] for v in by_op.values())
        return {
            "updates": updates,
            **rec(launches, moved),
            "syncs": round(sum(self.syncs.values()) / updates, 1),
            "sync_ops": {k: round(v / updates, 1) for k, v in sorted(self.syncs.items())},
            "sync_sites": {f"{phase} {site}": round(n / updates, 1) for (phase, site), n in
                           sorted(self.sync_sites.items(), key=lambda kv: (-kv[1], kv[0]))},
            "by_class": {k: rec(*v) for k, v in by_class.items()},
            "by_phase": {k: rec(*v) for k, v in by_phase.items()},
            "ops": {name: [round(n / updates, 1), round(b / updates / 2**20, 2)]
                    for name, (n, b) in sorted(by_op.items(), key=lambda kv: -kv[1][1])},
        }


def table(census: Dict[str, Dict]) -> str:
    """One line per run: launches, MB and syncs per applied update, then launches/MB by
    class; below it, a line for each other kind of update counted (:data:`KINDS`)."""
    classes = [k for k, _ in CLASSES]
    head = f"{'run':18s} {'launch':>7s} {'MB':>9s} {'syncs':>6s}  " + "  ".join(
        f"{c[:15]:>15s}" for c in classes)
    lines = [head, " " * 44 + "  ".join(f"{'launch/MB':>15s}" for _ in classes)]
    for name, c in census.items():
        if "error" in c:
            lines.append(f"{name:18s} census failed: {c['error']}")
            continue
        runs = [(name, c)] + [(f"  {kind}", k) for kind, k in c.get("kinds", {}).items()
                              if kind != "applied"]
        for label, r in runs:
            cells = "  ".join(f"{r['by_class'][k]['launches']:6.0f}/{r['by_class'][k]['mb']:8.1f}"
                              for k in classes)
            lines.append(f"{label:18s} {r['launches']:7.0f} {r['mb']:9.1f} {r['syncs']:6.1f}  {cells}")
    return "\n".join(lines)


def diff_table(base: Dict, other: Dict, top: int = 12) -> str:
    """The ``top`` operators whose launches and MB per update differ most between two runs."""
    a, b = base["ops"], other["ops"]
    rows = []
    for name in set(a) | set(b):
        (na, ma), (nb, mb) = a.get(name, (0.0, 0.0)), b.get(name, (0.0, 0.0))
        rows.append((abs(mb - ma) + abs(nb - na), name, nb - na, mb - ma))
    rows.sort(reverse=True)
    lines = [f"{'operator':32s} {'launches':>9s} {'MB':>9s}"]
    lines += [f"{name:32s} {dn:+9.0f} {dm:+9.1f}" for _, name, dn, dm in rows[:top]]
    return "\n".join(lines)


# --- the comparison of modes (scripts/op_census.py) ---------------------------------------

#: flags that give a CPU run of the plugin the operators of a CUDA run: torch's dropout in every
#: precision (the CPU's counter-based masks are a compiled hash, run op by op under the census);
#: for the half precisions also ``--half-matmul``, ``--attention-path`` and ``--fused-loss``,
#: which pick CPU paths by default, and no padding
AS_ON_CUDA_ANY = {"--cpu-dropout": "torch"}
AS_ON_CUDA = {**AS_ON_CUDA_ANY, "--half-matmul": "native", "--attention-path": "torch",
              "--cpu-length-multiple": "1", "--fused-loss": "stream"}


@contextlib.contextmanager
def step_marked(census: OpCensus, optimizer):
    """While open, ``optimizer.step`` runs with ``census.in_step`` set (its operators count as
    the ``step`` phase); the optimizer's own ``step`` is put back on exit."""
    own_step = vars(optimizer).get("step")  # an instance's own step, put back after
    opt_step = optimizer.step

    def marked_step(*a, **k):
        census.in_step = True
        try:
            return opt_step(*a, **k)
        finally:
            census.in_step = False

    optimizer.step = marked_step
    try:
        yield
    finally:
        if own_step is None:
            del optimizer.step  # the class's method again
        else:
            optimizer.step = own_step


#: what an update was: applied or skipped for overflow, and whether it began with the
#: plugin's non-finite watch armed (the update after an overflow)
KINDS = ("applied", "overflowed", "armed_applied", "armed_overflowed")


def _skipped(optimizer) -> int:
    """Updates the plugin's optimizer skipped for overflow so far (0 for another optimizer)."""
    return getattr(getattr(optimizer, "overflow", None), "skipped", 0)

class UpdatesByKind(UpdateWindow):
    """The census of every ``train_step`` call from call ``first`` on, one :class:`OpCensus`
    per update, added up by kind (:data:`KINDS`), until ``count`` applied updates are counted;
    then the summary goes to ``out_path`` as JSON: the applied updates' (the steady state, as
    :class:`.run_stats.UpdateCensus` takes it), ``armed_updates_skipped``, and ``kinds``, each
    kind's summary. Every update runs under a census, counted or not, so that a CPU half run's
    products run in fp32 throughout."""

    FLAG = "--updates"

    def __init__(self, first: int, count: int, out_path: str, name: str = "") -> None:
        super().__init__(first, count, out_path, name)
        self.kinds: Dict[str, OpCensus] = {}
        self.updates: Dict[str, int] = defaultdict(int)

    def wrap(self, trainer, step):
        def train_step(*args, **kwargs):
            self.calls += 1
            census = OpCensus(fp32_products=True)
            census.counting = self.calls >= self.first and self.summary is None
            optimizer = trainer.optimizer
            watch = getattr(optimizer, "watch", None)
            armed = watch is not None and watch.armed
            skipped = _skipped(optimizer)
            try:
                with step_marked(census, optimizer), census:
                    return step(*args, **kwargs)
            finally:
                if census.counting:
                    overflowed = _skipped(optimizer) > skipped
                    kind = ("armed_" if armed else "") + ("overflowed" if overflowed else "applied")
                    self.kinds.setdefault(kind, OpCensus()).merge(census)
                    self.updates[kind] += 1
                    if self.updates["applied"] == self.count:
                        self.finish()

        return train_step

    def finish(self) -> None:
        """Write the summary of the updates counted so far (once)."""
        if self.summary is not None or not self.updates.get("applied"):
            return
        kinds = {k: self.kinds[k].summary(self.updates[k]) for k in KINDS if self.updates.get(k)}
        self.summary = {"name": self.name, "first_update": self.first,
                        "armed_updates_skipped": self.updates["armed_applied"]
                        + self.updates["armed_overflowed"],
                        **kinds["applied"], "kinds": kinds}
        with open(self.out_path, "w") as f:
            json.dump(self.summary, f)


def census_worker(argv=None) -> int:
    """``FIRST:COUNT OUT.json fairseq-train ARGS...``: :class:`UpdatesByKind` over a
    ``fairseq-train`` run in this process (what :func:`run_census` starts)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    first, count = (int(x) for x in argv[0].split(":"))
    window = UpdatesByKind(first, count, argv[1], name=Path(argv[1]).stem)
    import fairseq_cli.train as train_module

    window.install(train_module)
    sys.argv = [argv[2], *argv[3:]]
    try:
        train_module.cli_main()
    finally:
        window.finish()
    return 0


def census_flags(mode: str) -> List[str]:
    """fairseq-train's flags for the census of ``mode``: its own, then :data:`AS_ON_CUDA` (half
    precisions) or :data:`AS_ON_CUDA_ANY` (fp32) where the mode does not set them; none for a
    stock mode."""
    flags = list(MODES[mode])
    if mode not in STOCK:
        half = "--fp16" in flags or "--bf16" in flags
        for flag, value in (AS_ON_CUDA if half else AS_ON_CUDA_ANY).items():
            if flag not in flags:  # the mode's own setting wins
                flags += [flag, value]
    return flags


def run_census(data, mode: str, model: str, first: int = 3, count: int = 2) -> Dict:
    """The census of a CPU fairseq-train run of ``mode`` (a mode of :mod:`.fairseq_train`),
    with the operators a CUDA run would launch: every update from ``first`` on, by kind
    (:class:`UpdatesByKind`), until ``count`` applied updates are counted."""
    flags = census_flags(mode)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = Path(tmp) / f"{mode}.json"
        cmd = [sys.executable, "-c", "import sys; from fairseq_fp16_tools.bench.op_census import "
               "census_worker; sys.exit(census_worker())", f"{first}:{count}", str(out_path),
               "fairseq-train", str(data),
               *plugin_args(mode), "--lr", "1e-3", *shlex.split(model),
               "--max-update", str(first + count), "--no-save", "--disable-validation",
               "--seed", "1", "--cpu", "--log-format", "simple", *flags]
        env = {**os.environ, **ENV.get(mode, {})}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        run = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if run.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"fairseq-train ({mode}) failed:\n{run.stderr[-3000:]}")
        census = json.loads(out_path.read_text())
    census["name"] = mode
    census["flags"] = flags
    return census


def main(argv=None) -> int:
    """``scripts/op_census.py``: the census of each mode on the same model, data and batch."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", nargs="?", help="data-bin directory (default: the synthetic corpus)")
    ap.add_argument("--modes", default="fp32,fp16,fp16-cache,fp16-unfused,bf16",
                    help="modes of scripts/bench_fairseq_train.py (not fp16-stock: stock "
                    "fairseq --fp16 needs CUDA)")
    ap.add_argument("--model", default=MODEL, help="fairseq-train's model and batch flags")
    ap.add_argument("--updates", default="3:2", help="FIRST:COUNT: every update from FIRST on "
                    "is counted, by kind, until COUNT have applied")
    a = ap.parse_args(argv)
    modes = parse_modes(ap, a.modes)
    try:
        first, count = (int(x) for x in a.updates.split(":"))
    except ValueError:
        ap.error(f"--updates takes FIRST:COUNT, e.g. 3:2; got {a.updates!r}")
    data = a.data
    if data is None:
        from ..corpus import write_corpus

        data = write_corpus(Path(tempfile.mkdtemp(prefix="census_toy_")))
    results = {}
    for mode in modes:
        try:
            results[mode] = run_census(data, mode, a.model, first, count)
        except RuntimeError as e:  # the other modes still count
            print(e, file=sys.stderr, flush=True)
            results[mode] = {"name": mode, "error": str(e).splitlines()[-1][:500]}
    print(table(results))
    for mode, c in results.items():
        if c.get("sync_sites"):
            print(f"\nhost syncs per update of {mode}, by phase and caller:")
            print("\n".join(f"{n:6.1f}  {site}" for site, n in c["sync_sites"].items()))
    base = modes[0]
    for mode in modes[1:]:
        if "error" not in results[base] and "error" not in results[mode]:
            print(f"\n{mode} against {base}:\n" + diff_table(results[base], results[mode]))
    for mode, c in results.items():
        for kind, k in c.get("kinds", {}).items():
            if kind != "applied":
                print(f"\n{mode}, {kind} update against an applied one:\n" + diff_table(c, k))
    print(json.dumps({"model": a.model, "updates": a.updates, "census": results, "provenance": describe()}))
    return 0
