"""scripts/bench_dropout.py: one row per size and dtype, ratios from the times it printed."""

import json

from fairseq_fp16_tools.bench.dropout import main


def test_each_size_and_dtype_gets_a_row_whose_ratios_are_its_times(capsys):
    assert main(["--sizes", "64,5000", "--repeats", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    record = json.loads(out[-1])
    assert record["p"] == 0.1 and record["machine"]["device"] == "cpu"
    assert record["provenance"]["torch"]
    for dtype in ("fp32", "bf16"):
        rows = record["results"][dtype]
        assert [r["numel"] for r in rows] == [64, 5000]
        for r in rows:
            assert r["speedup_fwd_bwd"] == round(r["torch_fwd_bwd_ms"] / r["counter_fwd_bwd_ms"], 2)
            assert min(r["torch_fwd_ms"], r["counter_fwd_ms"], r["mul_ms"]) > 0
    assert len([line for line in out if line.startswith(("fp32 ", "bf16 "))]) == 4
