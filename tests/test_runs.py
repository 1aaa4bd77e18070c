"""fairseq_fp16_tools.runs: what result.json takes from a run's SAVE_DIR/run_info.json."""

import json

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
