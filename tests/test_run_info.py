"""SAVE_DIR/run_info.json: what a run used, for the comparison tools (which read it instead of
the log)."""

import json

import pytest
import torch

from conftest import train
from fairseq_fp16.core.half_matmul import cpu_has_native_half

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("flags", [[], ["--fp16"], ["--bf16", "--fused-loss", "off"]])
def test_run_info_says_what_the_run_used(toy_data, tmp_path, flags):
    train(toy_data, tmp_path, *flags, "--max-update", "2")
    info = json.loads((tmp_path / "run_info.json").read_text())
    name = {"--fp16": "fp16", "--bf16": "bf16"}.get(flags[0] if flags else None, "fp32")
    assert info["precision"] == name and info["device"] == "cpu"
    assert info["fused_loss"] is (name == "fp16")
    assert info["attention"] == ("torch" if name == "fp32" else "fairseq")
    assert info["compile_layers"] is False and info["compile_step"] is False
    if name == "fp32":
        assert info["half_matmul"] is None and info["native_half_products"] is None
        return
    native = cpu_has_native_half(torch.float16 if name == "fp16" else torch.bfloat16)
    path = "native kernels" if native else "fp32 accumulation, rounded to half"
    assert info["half_matmul"] == f"{path} (--half-matmul auto)"
    assert info["native_half_products"] == (None if native else 0)


def test_no_run_info_without_checkpoints(toy_data, tmp_path):
    train(toy_data, tmp_path / "ck", "--fp16", "--max-update", "1", "--no-save")
    assert not (tmp_path / "ck" / "run_info.json").exists()


def test_runs_in_one_process_keep_their_own_precision(toy_data, tmp_path):
    """fp16, then bf16, then fp32, trained in one process: each run's model, optimizer and record
    are its own precision's (nothing of a run outlives it in the process)."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from conftest import TINY_MODEL, TRAIN, USER_DIR
    from fairseq_fp16.features import task_state
    from inprocess import fairseq_train

    seen = {}

    def look(trainer, extra_state):
        seen["model"] = next(p for n, p in trainer.model.named_parameters() if "fc1" in n).dtype
        seen["optimizer"] = trainer.optimizer.precision

    for flags, name, dtype in ((["--fp16"], "fp16", torch.float16),
                               (["--bf16"], "bf16", torch.bfloat16), ([], "fp32", torch.float32)):
        save_dir = tmp_path / name
        fairseq_train([toy_data, *TINY_MODEL, *TRAIN, "--user-dir", USER_DIR, "--save-dir", save_dir,
                       "--max-update", "1", *flags], on_load=look)
        info = json.loads((save_dir / "run_info.json").read_text())
        assert (seen["model"], seen["optimizer"], info["precision"]) == (dtype, name, name)
        assert info["fused_loss"] is (name != "fp32")
        # a task a script builds after the run (no command's main) reads its own config
        args = options.parse_args_and_arch(options.get_training_parser(), input_args=[
            str(toy_data), *TINY_MODEL, *TRAIN, "--user-dir", USER_DIR])
        task = tasks.setup_task(convert_namespace_to_omegaconf(args).task)
        assert task_state(task).precision.name == "fp32"
