"""scripts/make_toy_corpus.py: sentence lengths and the flag's errors."""

import random
import statistics
import subprocess
import sys

import pytest

from conftest import ROOT
from make_toy_corpus import make_pairs


def test_lengths_bound_the_words_of_both_sides():
    pairs = make_pairs(2000, random.Random(1), vocab=100, min_len=20, max_len=40)
    lens = [len(s.split()) for s, _ in pairs]
    assert min(lens) == 20 and max(lens) == 40 and 29 < statistics.fmean(lens) < 31
    assert all(len(t.split()) == n for (_, t), n in zip(pairs, lens))


@pytest.mark.parametrize("bad", ["12", "5,3", "0,4", "a,b", "3,4,5"])
def test_bad_lengths_are_refused_naming_the_flag(tmp_path, bad):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_toy_corpus.py"), str(tmp_path),
                           "--lengths", bad], capture_output=True, text=True)
    assert proc.returncode == 2
    assert f"--lengths must be MIN,MAX with 1 <= MIN <= MAX, got '{bad}'" in proc.stderr
    assert not (tmp_path / "raw").exists()
