"""fairseq_fp16_tools.runs: what result.json takes from a run's SAVE_DIR/run_info.json, and how a
comparison's files are read (a run missing or cut short is named, never read as present)."""

import json
import re

import pytest

from fairseq_fp16_tools.runs import run_info_fields


def test_run_info_maps_onto_result_json_fields(tmp_path):
    info = {"precision": "bf16", "device": "cpu", "half_matmul": "native kernels (--half-matmul auto)",
            "native_half_products": None, "batch_lengths": "padded to a multiple of 8 (--cpu-length-multiple auto)",
            "kernel_caches": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": 256}, "fused_loss": True,
            "attention": "fairseq", "compile_layers": False}
    (tmp_path / "run_info.json").write_text(json.dumps(info))
    assert run_info_fields(tmp_path) == {
        "half_matmul": "native kernels (--half-matmul auto)", "native_half_products": None,
        "batch_lengths": "padded to a multiple of 8 (--cpu-length-multiple auto)", "fused_loss": True,
        "attention": "fairseq", "compile_layers": False}


def test_a_run_without_run_info_used_nothing_of_the_plugin(tmp_path):
    # stock fairseq (compare.py's fp16-stock) runs without the plugin, which writes the file
    assert run_info_fields(tmp_path) == {"half_matmul": None, "native_half_products": None, "batch_lengths": None,
                                         "fused_loss": False, "attention": None, "compile_layers": None}


def _comparison(out, modes, results):
    """A compare.py --out directory whose settings.json asks for ``modes`` and holds the runs ``results``."""
    out.mkdir()
    (out / "settings.json").write_text(json.dumps({"data": "bin", "modes": modes, "seed": 1}))
    for mode in results:
        (out / mode).mkdir()
        (out / mode / "result.json").write_text(json.dumps({"mode": mode, "seed": 1}))
    return out


def test_load_results_names_a_json_file_cut_short_and_how_to_redo_it(tmp_path):
    from fairseq_fp16_tools.runs import load_results

    out = _comparison(tmp_path / "cmp", ["fp32", "fp16"], ["fp32", "fp16"])
    text = (out / "fp16" / "result.json").read_text()
    (out / "fp16" / "result.json").write_text(text[:20])  # a run stopped while writing it
    with pytest.raises(ValueError, match=re.escape(
            f"{out}/fp16/result.json is not valid JSON (Unterminated string starting at: line 1 column 18), "
            f"perhaps cut short as it was written; rerun it: delete {out}/fp16 and run scripts/compare.py "
            f"again with the same flags, --out {out} and --keep-existing (it trains only the runs without a "
            "result.json)")):
        load_results(out)
    (out / "settings.json").write_text('{"data": "bin", "modes": ["fp3')
    with pytest.raises(ValueError, match=re.escape(f"{out}/settings.json is not valid JSON (")):
        load_results(out)
    (out / "settings.json").unlink()  # the runs asked for are unknown: not read as if all were there
    with pytest.raises(ValueError, match=re.escape(
            f"{out}/settings.json is missing: {out} is not the --out of scripts/compare.py, or one that stopped "
            "before it wrote its settings")):
        load_results(out)


def test_load_results_leaves_out_the_missing_runs_and_missing_modes_names_them(tmp_path):
    from fairseq_fp16_tools.runs import load_results, missing_line, missing_modes

    out = _comparison(tmp_path / "cmp", ["fp32", "fp16-stock", "fp16", "fp32-seed2"], ["fp32", "fp32-seed2"])
    settings, results = load_results(out)
    assert [r["mode"] for r in results] == ["fp32", "fp32-seed2"]
    assert missing_modes(out, settings) == missing_modes(out) == ["fp16-stock", "fp16"]
    assert missing_line(out, ["fp16-stock", "fp16"]) == (
        f"2 requested runs without a result.json in {out}: fp16-stock, fp16 (scripts/compare.py stopped before "
        "finishing them, or is still running; their train.out or generate.out says why); rerun them: delete "
        f"{out}/fp16-stock, {out}/fp16 and run scripts/compare.py again with the same flags, --out {out} and "
        "--keep-existing (it trains only the runs without a result.json)")
    (out / "fp32" / "result.json").unlink()
    with pytest.raises(ValueError, match=re.escape(
            f"{out}: no fp32 result.json to compare against: 3 requested runs without a result.json in {out}: "
            "fp32, fp16-stock, fp16 (")):
        load_results(out)
