"""scripts/run_stats.py: the stats file is written whatever the outcome."""

import json
import subprocess
import sys

# run_stats.main on ``fairseq-train --help`` (exits 0 at once), its machine() replaced when asked
DRIVER = r"""
import sys
from fairseq_fp16_tools.bench import run_stats
if sys.argv[2] == "broken":
    def broken(args):
        raise RuntimeError("no /proc here")
    run_stats.machine = broken
sys.exit(run_stats.main([sys.argv[1], "fairseq-train", "--help"]))
"""


def _run(tmp_path, how):
    stats = tmp_path / "stats.json"
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(stats), how],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(stats.read_text())


def test_stats_are_written_when_reading_the_machine_fails(tmp_path):
    out = _run(tmp_path, "broken")
    assert out["exit_code"] == 0 and out["wall_s"] > 0 and out["peak_rss_mb"] > 0
    assert (out["machine"], out["machine_error"]) == (None, "RuntimeError('no /proc here')")


def test_the_machine_is_recorded_otherwise(tmp_path):
    out = _run(tmp_path, "ok")
    assert out["machine"]["cpu_cores"] >= 1 and out["machine"]["torch"]
    assert "machine_error" not in out


class FakeCuda:
    """torch.cuda's allocator statistics, as numbers this test moves."""

    def __init__(self):
        self.allocated = self.peak = 0

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def alloc(self, mb):
        self.allocated += mb * 2**20
        self.peak = max(self.peak, self.allocated)

    def free(self, mb):
        self.allocated -= mb * 2**20

    def max_memory_allocated(self, device=None):
        return self.peak

    def reset_peak_memory_stats(self, device=None):
        self.peak = self.allocated


def _like_fairseq_train(cuda):
    cuda.alloc(100)  # model and optimizer state
    for activations in (400, 700, 300):  # an update, then fairseq's reset for its gb_free
        cuda.alloc(activations)
        cuda.free(activations)
        cuda.reset_peak_memory_stats()


def test_cuda_peak_survives_fairseqs_per_update_resets():
    from fairseq_fp16_tools.bench.run_stats import CudaPeak

    bare = FakeCuda()
    _like_fairseq_train(bare)
    assert bare.max_memory_allocated() / 2**20 == 100  # what was recorded before: the state only
    cuda = FakeCuda()
    peak = CudaPeak(cuda)
    _like_fairseq_train(cuda)
    assert peak.peak_mb() == 800
    cuda.alloc(900)  # a peak after the last reset counts too
    assert peak.peak_mb() == 1000
