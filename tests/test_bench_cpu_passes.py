"""scripts/bench_cpu_passes.py: one row per pass, its floor and ratios from the times it printed."""

import json

import pytest

from fairseq_fp16_tools.bench.cpu_passes import main


def _ratio_of(ratio, num, den, digits=3):
    """Whether ``ratio`` (rounded to 2 places) is ``num / den`` for some values that round to the
    printed ``num`` and ``den`` (``digits`` places)."""
    half = 0.5 * 10.0 ** -digits
    return (num - half) / (den + half) - 0.005 <= ratio <= (num + half) / (den - half) + 0.005


def test_each_pass_gets_its_floor_and_its_alternatives_ratios(capsys):
    shape = ["--length", "5", "--batch", "6", "--width", "16", "--ffn", "32", "--heads", "2"]
    assert main([*shape, "--repeats", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    record = json.loads(out[-1])
    assert record["shape"] == {"length": 5, "batch": 6, "width": 16, "ffn": 32, "heads": 2}
    assert record["machine"]["device"] == "cpu" and record["provenance"]["torch"]
    rows = {r["pass"]: r for r in record["results"]}
    assert list(rows) == ["dropout+add+norm", "relu", "bias grad", "head copy", "attention"]
    tokens = 5 * 6
    # bytes: each tensor read once and written once, 2 bytes an element
    assert rows["dropout+add+norm"]["mb"] == round(tokens * 16 * 24 / 1e6, 2)
    assert rows["relu"]["mb"] == round(tokens * 32 * 10 / 1e6, 2)
    assert rows["head copy"]["mb"] == round(tokens * 16 * 4 / 1e6, 2)
    for r in rows.values():
        assert r["ms"] > 0
        if r["floor_ms"] is not None:
            assert _ratio_of(r["over_floor"], r["ms"], r["floor_ms"])
        for alt in r["alternatives"].values():
            assert _ratio_of(alt["x_current"], alt["ms"], r["ms"])
    assert set(rows["dropout+add+norm"]["alternatives"]) == {"compiled as one", "torch layer_norm"}
    assert set(rows["attention"]["alternatives"]) == {"contiguous operands", "sdpa"}
    assert rows["attention"]["floor_ms"] is None
    assert len([line for line in out if line.startswith(tuple(rows))]) == 5


def test_a_width_the_heads_do_not_divide_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--width", "10", "--heads", "4"])
    assert "--width a multiple of --heads" in capsys.readouterr().err
