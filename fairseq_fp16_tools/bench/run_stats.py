"""Run a fairseq CLI in this process and record its wall time and peak memory.

    python scripts/run_stats.py [--profile-updates FIRST:COUNT PROFILE.json]
        [--census-updates FIRST:COUNT CENSUS.json] STATS.json fairseq-train ARGS...

Writes ``{"wall_s", "peak_rss_mb", "peak_cuda_mb", "exit_code", "machine", "provenance"}``
to STATS.json when the command ends, whatever the outcome (``machine``: see :func:`machine`;
``provenance``: :func:`fairseq_fp16_tools.provenance.describe`), and for fairseq-train
``intervals``, one record per log interval (:class:`IntervalLog`: updates attempted and
skipped, applied words, wall time, torch.compile compilations, resident memory) and
``memory_before_first_update``. Peak RSS is the process's high-water mark
(``/proc/self/status``'s VmHWM where there is one: getrusage's also counts the program that ran
before ``exec``), so it includes the interpreter and torch (a few hundred MB); on CUDA,
``peak_cuda_mb`` is the allocator's peak over the whole run (:class:`CudaPeak`). It imports nothing of fairseq before the CLI module, so the CLI sets up
logging.

With ``--profile-updates FIRST:COUNT PROFILE.json`` COUNT ``Trainer.train_step`` calls run
under ``torch.profiler``, from the one that begins update FIRST (the first call made at
fairseq's ``num_updates`` FIRST-1: updates skipped for overflow earlier do not move the window
into the updates before it) to the start of the call after them, and PROFILE.json gets their
summary (:func:`bench.profile_summary.summarize_trace`: device busy and idle time, time by kernel
class, launches and host syncs per update) with the run's ``provenance``. The run needs at least
FIRST+COUNT updates.

With ``--census-updates FIRST:COUNT CENSUS.json`` those updates' ``train_step`` calls run under
:class:`bench.op_census.OpCensus` instead, and CENSUS.json gets the operators, bytes and host
syncs per update (on any device; the counts do not depend on the machine's speed; CPU half
matrix products run as fp32 products rounded to half).
"""

import json
import os
import platform
import resource
import sys
import time
from importlib import metadata

from .windows import UpdateWindow, install_step_wrapper

CLIS = {
    "fairseq-train": "fairseq_cli.train",
    "fairseq-generate": "fairseq_cli.generate",
}


def _cpuinfo() -> dict:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def _cpu_id(info: dict):
    """Family, model, stepping and cache of the CPU, which tell apart two CPUs that a virtual
    machine gives the same model name ("Intel(R) Xeon(R) Processor"); None off Linux."""
    if "model" not in info:
        return None
    return (f"family {info.get('cpu family')} model {info['model']} stepping {info.get('stepping')}, "
            f"cache {info.get('cache size')}")


def _version(*dists: str):
    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            pass
    return None


def machine(args) -> dict:
    """What a run's speed and memory depend on, read in the process that ran it.

    ``cpu``: the CPU's model name; ``cpu_id``: its family, model, stepping and cache;
    ``cpu_cores``: the cores this process may use;
    ``cpu_capability``: the instruction set torch picks its CPU kernels for (``AVX2``,
    ``AVX512``, ...: fp32 results differ between them in the last bits);
    ``cpu_native_bf16`` / ``cpu_native_fp16``: whether the CPU has arithmetic units for
    them (what ``--half-matmul auto`` decides by); ``device``: ``cpu`` or the CUDA
    device's name; versions of torch, fairseq and Python.
    """
    import torch

    from fairseq_fp16.core.half_matmul import cpu_has_native_half

    cuda = torch.cuda.is_available() and "--cpu" not in args
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = _cpuinfo()
    return {
        "cpu": info.get("model name") or platform.processor() or platform.machine(),
        "cpu_id": _cpu_id(info),
        "cpu_cores": cores,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_native_bf16": cpu_has_native_half(torch.bfloat16),
        "cpu_native_fp16": cpu_has_native_half(torch.float16),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "fairseq": _version("fairseq-fixed", "fairseq"),
        "python": platform.python_version(),
    }


class CudaPeak:
    """The CUDA allocator's peak over a whole run.

    fairseq's trainer calls ``torch.cuda.reset_peak_memory_stats()`` after every update (to log
    ``gb_free``), so at the end of a run ``max_memory_allocated()`` holds only what was allocated
    after the last update: about the model and optimizer state, not the peak of training. While
    installed, each reset first keeps the peak it clears. ``cuda`` is ``torch.cuda`` (a stand-in
    in the tests).
    """

    def __init__(self, cuda) -> None:
        self.cuda = cuda
        self._kept = 0
        self._reset = cuda.reset_peak_memory_stats
        cuda.reset_peak_memory_stats = self._reset_keeping_peak

    def _reset_keeping_peak(self, device=None) -> None:
        if self.cuda.is_initialized():
            self._kept = max(self._kept, self.cuda.max_memory_allocated(device))
        self._reset(device)

    def peak_mb(self):
        """Peak MB since installed, or None when CUDA was never used."""
        if not (self.cuda.is_available() and self.cuda.is_initialized()):
            return None
        return max(self._kept, self.cuda.max_memory_allocated()) / 2**20


def _compiles() -> int:
    """Frames torch.compile has compiled in this process (dynamo's ``frames/ok`` counter; 0
    where dynamo was never imported)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["frames"]["ok"]) if utils is not None else 0


def _memory_mb() -> dict:
    """The process's resident memory now (``rss_mb``) and its high-water mark so far
    (``peak_rss_mb``), in MB: ``/proc/self/status``'s VmRSS and VmHWM (this program's own: a new
    one begins at ``exec``); where there is no such file, getrusage's high-water mark for both."""
    fields = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    fields[key] = int(value.split()[0]) / 1024.0  # kB
    except OSError:
        pass
    hwm = fields.get("VmHWM", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)
    return {"rss_mb": round(fields.get("VmRSS", hwm), 1), "peak_rss_mb": round(hwm, 1)}


def _sync_cuda() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class IntervalLog:
    """One record per fairseq log interval of a fairseq-train run, counted around
    ``Trainer.train_step``.

    An interval ends with the applied update that brings ``num_updates`` to a multiple of
    ``--log-interval``, as fairseq's ``train_inner`` records do. Each record:
    ``num_updates`` (at its end), ``attempted`` (train_step calls), ``skipped`` (calls that
    left ``num_updates`` where it was: overflow skips), ``words`` (the target tokens of the
    applied updates, fairseq's ``ntokens``), ``wall_ms`` (from the end of the previous
    interval, or the start of the first call, to its end, loading and logging included) and
    ``compiles`` (frames torch.compile compiled in it; after the first update each is a
    recompile), ``rss_mb`` and ``peak_rss_mb`` (:func:`_memory_mb` at its end; the peak the
    largest reading so far: Linux counts a thread's pages lazily, so its high-water mark can
    read a fraction of a MB lower than it did before).
    ``before_first_update`` is :func:`_memory_mb` as the first call begins: the imports, the
    data, the model and whatever the run built before training. The device is synchronized at
    each interval's end (fairseq's log line that follows waits for it anyway); no other host
    sync is added. ``clock``, ``compiles`` and ``memory`` are injectable for tests.
    """

    def __init__(self, clock=time.perf_counter, compiles=_compiles, sync=_sync_cuda,
                 memory=_memory_mb) -> None:
        self.clock, self.compiles, self.sync, self.memory = clock, compiles, sync, memory
        self.intervals = []
        self.before_first_update = None
        self._peak = 0.0
        self._start = None
        self._open = None

    def install(self, train_module) -> None:
        install_step_wrapper(train_module, self.wrap)

    def _memory(self) -> dict:
        reading = self.memory()
        self._peak = max(self._peak, reading["peak_rss_mb"])
        return {**reading, "peak_rss_mb": self._peak}

    def _reset(self, start: float) -> None:
        self._start, self._compiles0 = start, self.compiles()
        self._open = {"attempted": 0, "skipped": 0, "words": 0}

    def wrap(self, trainer, step):
        every = trainer.cfg.common.log_interval

        def train_step(samples, *args, **kwargs):
            if self._open is None:
                self.before_first_update = self._memory()
                self._reset(self.clock())
            before = trainer.get_num_updates()
            result = step(samples, *args, **kwargs)
            after = trainer.get_num_updates()
            acc = self._open
            acc["attempted"] += 1
            if after == before:
                acc["skipped"] += 1
            else:
                batches = [samples] if isinstance(samples, dict) else samples or []
                acc["words"] += sum(int(s.get("ntokens") or 0) for s in batches if s)
                if after % every == 0:
                    self.sync()
                    end = self.clock()
                    self.intervals.append({"num_updates": after, **acc,
                                           "wall_ms": round((end - self._start) * 1000.0, 3),
                                           "compiles": self.compiles() - self._compiles0,
                                           **self._memory()})
                    self._reset(end)
            return result

        return train_step


class UpdateProfiler(UpdateWindow):
    """``torch.profiler`` over ``count`` updates of a fairseq run from update ``first`` on.

    The profiler starts as the first ``train_step`` call made at ``num_updates == first - 1``
    begins and stops as the ``count``-th call after it begins (or at :meth:`finish`), with the
    device synchronized at both ends, so the window holds whole updates with the loader and
    logging between them. The summary (with ``name`` and the run's provenance) is written to
    ``out_path`` as JSON.
    """

    FLAG = "--profile-updates"

    def __init__(self, first: int, count: int, out_path: str, name: str = "") -> None:
        super().__init__(first, count, out_path, name)
        self.step_ms = []
        self._prof = None
        self._start = None
        self._began = None  # the call the window began at

    def wrap(self, trainer, step):
        def train_step(*args, **kwargs):
            self.calls += 1
            if self._began is None and trainer.get_num_updates() >= self.first - 1:
                self._began = self.calls
                self._begin()
            elif self._began is not None and self.calls == self._began + self.count:
                self.finish()
            start = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                if self._prof is not None:
                    self.step_ms.append((time.perf_counter() - start) * 1000.0)

        return train_step

    @staticmethod
    def _sync() -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def _begin(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(ProfilerActivity.CUDA)
        self._sync()
        self._prof = profile(activities=activities)
        self._prof.__enter__()
        self._start = time.perf_counter()

    def finish(self) -> None:
        """Stop the profiler (if running) and write the summary of the updates it saw."""
        if self._prof is None:
            return
        import tempfile

        from .profile_summary import summarize_trace

        self._sync()
        window_ms = (time.perf_counter() - self._start) * 1000.0
        prof, self._prof = self._prof, None
        try:  # a broken profile must not fail the run it measured
            prof.__exit__(None, None, None)
            with tempfile.TemporaryDirectory() as tmp:
                trace_path = os.path.join(tmp, "trace.json")
                prof.export_chrome_trace(trace_path)
                with open(trace_path) as f:
                    trace = json.load(f)
            summary = summarize_trace(trace, len(self.step_ms), window_ms, self.step_ms)
        except Exception as e:
            summary = {"error": repr(e)}
        self.summary = {"name": self.name, "first_update": self.first, **summary,
                        "provenance": _provenance()}
        with open(self.out_path, "w") as f:
            json.dump(self.summary, f)


class UpdateCensus(UpdateWindow):
    """:class:`bench.op_census.OpCensus` counting ``count`` ``train_step`` calls from call
    ``first`` on (the optimizer's ``step`` marked as the step phase); the summary (with
    ``name``) goes to ``out_path`` as JSON after the last of them. Every update runs under the
    census, counted or not, so that a CPU half run's products run in fp32 throughout.

    An update that begins with the plugin's non-finite watch armed (the one after an overflow:
    it checks every module's output) is not counted and the window moves on by one, so the
    census is of steady-state updates; ``armed_updates_skipped`` says how many.
    """

    FLAG = "--census-updates"

    def __init__(self, first: int, count: int, out_path: str, name: str = "") -> None:
        super().__init__(first, count, out_path, name)
        self.counted = 0
        self.skipped = 0
        self.census = None

    def wrap(self, trainer, step):
        from .op_census import OpCensus, step_marked

        def train_step(*args, **kwargs):
            # every update runs under the census (its fp32 products keep CPU half runs fast);
            # the window's are counted
            self.calls += 1
            if self.census is None:
                self.census = OpCensus(fp32_products=True)
            optimizer = trainer.optimizer
            watch = getattr(optimizer, "watch", None)
            counting = self.calls >= self.first and self.counted < self.count
            if counting and watch is not None and watch.armed:
                self.skipped += 1
                counting = False
            self.census.counting = counting
            try:
                with step_marked(self.census, optimizer), self.census:
                    return step(*args, **kwargs)
            finally:
                self.census.counting = False
                if counting:
                    self.counted += 1
                    if self.counted == self.count:
                        self.finish()

        return train_step

    def finish(self) -> None:
        """Write the summary of the updates counted so far (once)."""
        if not self.counted or self.summary is not None:
            return
        self.summary = {"name": self.name, "first_update": self.first,
                        "armed_updates_skipped": self.skipped,
                        **self.census.summary(self.counted)}
        with open(self.out_path, "w") as f:
            json.dump(self.summary, f)


def _provenance():
    """The run's provenance record, or ``{"error": ...}``: it must not fail the run it describes."""
    from ..provenance import describe

    try:
        return describe()
    except Exception as e:
        return {"error": repr(e)}


def _parse_window_flags(argv):
    """(UpdateProfiler or None, UpdateCensus or None, remaining argv) from leading
    ``--profile-updates F:N PATH`` / ``--census-updates F:N PATH``."""
    windows = {"--profile-updates": UpdateProfiler, "--census-updates": UpdateCensus}
    found = {}
    while argv and argv[0] in windows:
        flag = argv[0]
        try:
            first, count = (int(x) for x in argv[1].split(":"))
            path = argv[2]
        except (IndexError, ValueError):
            raise SystemExit(f"{flag} takes FIRST:COUNT and a JSON path, e.g. "
                             f"{flag} 31:3 out.json") from None
        name = os.path.splitext(os.path.basename(path))[0]
        found[flag] = windows[flag](first, count, path, name=name)
        argv = argv[3:]
    return found.get("--profile-updates"), found.get("--census-updates"), argv


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: python scripts/run_stats.py [--profile-updates FIRST:COUNT PROFILE.json] "
             f"[--census-updates FIRST:COUNT CENSUS.json] STATS.json {{{','.join(CLIS)}}} ARGS...")
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{usage}\n\n{__doc__}")
        return 0
    profiler, census, argv = _parse_window_flags(argv)
    if len(argv) < 2 or argv[1] not in CLIS:
        print(usage, file=sys.stderr)
        return 2
    if profiler is not None and census is not None:
        raise SystemExit("--profile-updates and --census-updates: one at a time (the census "
                         "would count the profiler's own work)")
    stats_path, tool, args = argv[0], argv[1], argv[2:]
    import importlib

    import torch

    cuda_peak = CudaPeak(torch.cuda)
    module = importlib.import_module(CLIS[tool])
    intervals = None
    if tool == "fairseq-train":
        intervals = IntervalLog()
        intervals.install(module)  # innermost: next to fairseq's own train_step
    for flag, window in (("--profile-updates", profiler), ("--census-updates", census)):
        if window is not None:
            if tool != "fairseq-train":
                raise SystemExit(f"{flag}: only fairseq-train runs updates")
            window.install(module)
    sys.argv = [tool, *args]
    start = time.perf_counter()
    code = 0
    try:
        module.cli_main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        code = 1
        raise
    finally:
        if profiler is not None:
            profiler.finish()
        if census is not None:
            census.finish()
        stats = {
            "wall_s": time.perf_counter() - start,
            "peak_rss_mb": max(_memory_mb()["peak_rss_mb"], intervals._peak if intervals else 0.0),
            "peak_cuda_mb": cuda_peak.peak_mb(),
            "exit_code": code,
        }
        if intervals is not None:
            stats["intervals"] = intervals.intervals
            stats["memory_before_first_update"] = intervals.before_first_update
        try:
            stats["machine"] = machine(args)
        except Exception as e:  # the timings still get written, and the run's own error raised
            stats["machine"] = None
            stats["machine_error"] = repr(e)
        stats["provenance"] = _provenance()
        with open(stats_path, "w") as f:
            json.dump(stats, f)
    return code

