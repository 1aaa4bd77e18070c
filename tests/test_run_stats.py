"""scripts/run_stats.py: the stats file is written whatever the outcome."""

import json
import subprocess
import sys

from conftest import ROOT

# run_stats.main on ``fairseq-train --help`` (exits 0 at once), its machine() replaced when asked
DRIVER = r"""
import sys
sys.path.insert(0, sys.argv[1])
import run_stats
if sys.argv[3] == "broken":
    def broken(args):
        raise RuntimeError("no /proc here")
    run_stats.machine = broken
sys.exit(run_stats.main([sys.argv[2], "fairseq-train", "--help"]))
"""


def _run(tmp_path, how):
    stats = tmp_path / "stats.json"
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(ROOT / "scripts"), str(stats), how],
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
