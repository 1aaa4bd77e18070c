"""scripts/make_toy_corpus.py: sentence lengths and the flag's errors."""

import statistics
import subprocess
import sys

import pytest

from conftest import ROOT


def test_lengths_flag_sets_the_words_of_both_sides(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_toy_corpus.py"), str(tmp_path),
                           "--train", "400", "--valid", "5", "--test", "5", "--vocab", "100",
                           "--lengths", "20,40"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    src = (tmp_path / "raw" / "train.src").read_text().splitlines()
    tgt = (tmp_path / "raw" / "train.tgt").read_text().splitlines()
    lens = [len(s.split()) for s in src]
    assert len(src) == 400 and min(lens) == 20 and max(lens) == 40 and 28 < statistics.fmean(lens) < 32
    assert [len(t.split()) for t in tgt] == lens
    assert (tmp_path / "bin" / "train.src-tgt.src.bin").exists()


@pytest.mark.parametrize("bad", ["12", "5,3", "0,4", "a,b", "3,4,5"])
def test_bad_lengths_are_refused_naming_the_flag(tmp_path, bad):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_toy_corpus.py"), str(tmp_path),
                           "--lengths", bad], capture_output=True, text=True)
    assert proc.returncode == 2
    assert f"--lengths must be MIN,MAX with 1 <= MIN <= MAX, got '{bad}'" in proc.stderr
    assert not (tmp_path / "raw").exists()
