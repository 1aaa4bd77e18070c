"""scripts/run_stats.py: the stats file is written whatever the outcome, with the run's
provenance and its log intervals; the profiled window's start."""

import json
import subprocess
import sys
from types import SimpleNamespace

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


def test_the_stats_record_the_provenance_and_the_intervals(tmp_path):
    from fairseq_fp16_tools.provenance import SOURCES

    out = _run(tmp_path, "ok")
    assert out["intervals"] == [] and out["memory_before_first_update"] is None  # --help trains nothing
    provenance = out["provenance"]
    assert len(provenance["commit"]) == 40 and provenance["commit_from"] == "git"
    assert list(provenance["source_hashes"]) == list(SOURCES) and provenance["torch"] == out["machine"]["torch"]


class FakeTrainer:
    """fairseq's Trainer as the step wrappers see it: ``num_updates`` moves on each applied
    update; calls listed in ``overflow`` are skipped. Each call takes 0.25 s of ``now``."""

    def __init__(self, overflow=(), compile_at=None):
        self.cfg = SimpleNamespace(common=SimpleNamespace(log_interval=5))
        self.updates, self.calls, self.now, self.compiled = 0, 0, 0.0, 0
        self.overflow, self.compile_at = set(overflow), compile_at or {}

    def get_num_updates(self):
        return self.updates

    def train_step(self, samples):
        self.calls += 1
        self.now += 0.25
        self.compiled += self.compile_at.get(self.calls, 0)
        if self.calls not in self.overflow:
            self.updates += 1


def test_the_interval_log_counts_skips_words_and_compiles_per_log_interval():
    from fairseq_fp16_tools.bench.run_stats import IntervalLog

    trainer = FakeTrainer(overflow={2, 3, 9}, compile_at={1: 12, 8: 1})
    # a high-water mark read 0.5 MB lower at the second interval's end than at the first's
    memory = lambda: {"rss_mb": 100.0 + trainer.calls, "peak_rss_mb": {13: 206.5}.get(trainer.calls, 200.0 + trainer.calls)}
    log = IntervalLog(clock=lambda: trainer.now, compiles=lambda: trainer.compiled, sync=lambda: None,
                      memory=memory)
    step = log.wrap(trainer, trainer.train_step)
    for _ in range(14):  # update_freq 2, one of them a dummy batch
        step([{"ntokens": 60}, {"ntokens": 40}, {}])
    # calls 1-7: five applied, two skipped; 8-13: five applied, one skipped; 14 opens the third
    assert log.intervals == [
        {"num_updates": 5, "attempted": 7, "skipped": 2, "words": 500, "wall_ms": 1750.0, "compiles": 12,
         "rss_mb": 107.0, "peak_rss_mb": 207.0},
        {"num_updates": 10, "attempted": 6, "skipped": 1, "words": 500, "wall_ms": 1500.0, "compiles": 1,
         "rss_mb": 113.0, "peak_rss_mb": 207.0}]  # the largest so far
    assert log.before_first_update == {"rss_mb": 100.0, "peak_rss_mb": 200.0}  # before call 1


def test_the_memory_reading_is_this_process_resident_set():
    """Writing 64 MB more raises _memory_mb's resident memory by about that, its peak with it."""
    from fairseq_fp16_tools.bench.run_stats import _memory_mb

    before = _memory_mb()
    block = b"\x01" * (64 << 20)  # every page written
    after = _memory_mb()
    assert 60 < after["rss_mb"] - before["rss_mb"] < 80 and after["peak_rss_mb"] >= after["rss_mb"]
    del block


def test_the_profiled_window_begins_at_its_update_after_skipped_ones():
    """--profile-updates 6:3 when two earlier calls overflowed: the window begins at call 8, the
    first made at num_updates 5, and ends as call 11 begins."""
    from fairseq_fp16_tools.bench.run_stats import UpdateProfiler

    events = []

    class Window(UpdateProfiler):
        def _begin(self):
            events.append(("begin", self.calls))
            self._prof = object()

        def finish(self):
            events.append(("finish", self.calls))
            self._prof = None

    trainer = FakeTrainer(overflow={2, 3})
    step = Window(6, 3, "p.json").wrap(trainer, trainer.train_step)
    for _ in range(12):
        step([])
    assert events == [("begin", 8), ("finish", 11)]


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
