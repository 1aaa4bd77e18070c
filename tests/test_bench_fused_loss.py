"""scripts/bench_fused_loss.py: one row per shape and dtype, each path timed, the default named
by the logits' size, its ratio from the times it printed."""

import json

import pytest

from fairseq_fp16.core.fused_loss import PATHS
from fairseq_fp16_tools.bench.fused_loss import main


def test_each_shape_and_dtype_gets_a_row_with_every_path_and_the_default(capsys):
    assert main(["--shapes", "64x100,128x8192", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    record = json.loads(out[-1])
    assert record["epsilon"] == 0.1 and record["machine"]["device"] == "cpu"
    assert record["provenance"]["torch"]
    for dtype in ("bf16", "fp16"):
        rows = record["results"][dtype]
        assert [(r["rows"], r["vocab"]) for r in rows] == [(64, 100), (128, 8192)]
        # 128 x 8192 is 2**20 logits: the CPU's compiled path from there
        assert [r["default"] for r in rows] == ["cache", "compiled"]
        for r in rows:
            assert min(r["fairseq_ms"], r["pass_ms"], *(r[f"{p}_ms"] for p in PATHS)) > 0
            assert r["default_over_fairseq"] == round(r[f"{r['default']}_ms"] / r["fairseq_ms"], 3)
    assert len([line for line in out if line.startswith(("bf16 ", "fp16 "))]) == 4


@pytest.mark.parametrize("shapes", ["64", "64x", "0x100", "64x100x3"])
def test_bad_shapes_are_refused_naming_the_flag(shapes, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--shapes", shapes])
    assert exit_.value.code == 2
    assert "--shapes needs TOKENSxVOCAB pairs of counts >= 1" in capsys.readouterr().err
