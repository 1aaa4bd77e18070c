"""Run a fairseq CLI in this process and record its wall time and peak memory.

    python scripts/run_stats.py STATS.json fairseq-train ARGS...

Writes ``{"wall_s", "peak_rss_mb", "peak_cuda_mb", "exit_code", "machine"}`` to
STATS.json when the command ends, whatever the outcome (``machine``: see
:func:`machine`). Peak RSS is the process's
high-water mark (``getrusage``), so it includes the interpreter and torch
(a few hundred MB); on CUDA, ``peak_cuda_mb`` is the allocator's peak over the whole run
(:class:`CudaPeak`). It imports nothing of fairseq before the CLI module, so the CLI sets up
logging.
"""

import json
import os
import platform
import resource
import sys
import time
from importlib import metadata

CLIS = {
    "fairseq-train": "fairseq_cli.train",
    "fairseq-generate": "fairseq_cli.generate",
}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(*dists: str):
    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            pass
    return None


def machine(args) -> dict:
    """What a run's speed and memory depend on, read in the process that ran it.

    ``cpu``: the CPU's model name; ``cpu_cores``: the cores this process may use;
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
    return {
        "cpu": _cpu_name(),
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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[1] not in CLIS:
        print(f"usage: python scripts/run_stats.py STATS.json {{{','.join(CLIS)}}} ARGS...",
              file=sys.stderr)
        return 2
    stats_path, tool, args = argv[0], argv[1], argv[2:]
    import importlib

    import torch

    cuda_peak = CudaPeak(torch.cuda)
    module = importlib.import_module(CLIS[tool])
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
        stats = {
            "wall_s": time.perf_counter() - start,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
            "peak_cuda_mb": cuda_peak.peak_mb(),
            "exit_code": code,
        }
        try:
            stats["machine"] = machine(args)
        except Exception as e:  # the timings still get written, and the run's own error raised
            stats["machine"] = None
            stats["machine_error"] = repr(e)
        with open(stats_path, "w") as f:
            json.dump(stats, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
