"""Run a fairseq CLI in this process and record its wall time and peak memory.

    python scripts/run_stats.py STATS.json fairseq-train ARGS...

Writes ``{"wall_s", "peak_rss_mb", "peak_cuda_mb", "exit_code"}`` to STATS.json
when the command ends, whatever the outcome. Peak RSS is the process's
high-water mark (``getrusage``), so it includes the interpreter and torch
(a few hundred MB); on CUDA, ``peak_cuda_mb`` is the allocator's peak.
It imports nothing of fairseq before the CLI module, so the CLI sets up logging.
"""

import json
import resource
import sys
import time

CLIS = {
    "fairseq-train": "fairseq_cli.train",
    "fairseq-generate": "fairseq_cli.generate",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[1] not in CLIS:
        print(f"usage: python scripts/run_stats.py STATS.json {{{','.join(CLIS)}}} ARGS...",
              file=sys.stderr)
        return 2
    stats_path, tool, args = argv[0], argv[1], argv[2:]
    import importlib

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
        import torch

        stats = {
            "wall_s": time.perf_counter() - start,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
            "peak_cuda_mb": (torch.cuda.max_memory_allocated() / 2**20
                             if torch.cuda.is_available() and torch.cuda.is_initialized() else None),
            "exit_code": code,
        }
        with open(stats_path, "w") as f:
            json.dump(stats, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
