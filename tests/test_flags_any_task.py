"""The plugin's flags exist, take effect and are checked with any task: fairseq's own dataclass
task (translation), a legacy task with a dataclass (language_modeling), a legacy task with
add_args only (translation_multi_simple_epoch), and a hydra config. Runs in the test process
(tests/inprocess.py) except --help and fairseq-hydra-train, which are about the command."""

import json
import re
import subprocess
import sys

import pytest
import torch

from conftest import CLI_ENV, TINY_MODEL, USER_DIR, run_cli
from inprocess import fairseq_train

FLAGS = ["--loss-scale", "--loss-scale-hysteresis", "--max-consecutive-overflows", "--fp32-modules",
         "--half-matmul", "--fused-loss", "--attention-path", "--cpu-dropout", "--compile-layers",
         "--compile-step", "--length-buckets", "--cuda-graphs", "--scale-trace",
         "--precision-stats-interval", "--precision-stats", "--precision-divergence-interval",
         "--precision-divergence"]
GROUP = "fairseq_fp16: mixed precision"

LM_MODEL = ["--arch", "transformer_lm", "--decoder-layers", "1", "--decoder-embed-dim", "32",
            "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2"]
TASKS = {
    "translation": ["--task", "translation", *TINY_MODEL],
    "language_modeling": ["--task", "language_modeling", *LM_MODEL, "--tokens-per-sample", "32",
                          "--sample-break-mode", "none"],
    # two pairs read from the one bitext (fairseq finds tgt-src in the src-tgt files)
    "translation_multi_simple_epoch": ["--task", "translation_multi_simple_epoch", *TINY_MODEL,
                                       "--lang-pairs", "src-tgt,tgt-src", "--langs", "src,tgt",
                                       "--encoder-langtok", "src", "--decoder-langtok"],
}
RUN = ["--optimizer", "adam", "--lr", "1e-3", "--criterion", "cross_entropy", "--max-tokens", "1000",
       "--cpu", "--seed", "1", "--num-workers", "0", "--disable-validation", "--no-save"]


@pytest.fixture(scope="module")
def data(toy_data, tmp_path_factory):
    """Each task's data-bin: the toy bitext, and its source side as a language-modelling corpus
    (fairseq's monolingual file names, linked to the bitext's)."""
    lm = tmp_path_factory.mktemp("lm")
    (lm / "dict.txt").symlink_to(toy_data / "dict.src.txt")
    for split in ("train", "valid"):
        for ext in ("bin", "idx"):
            (lm / f"{split}.{ext}").symlink_to(toy_data / f"{split}.src-tgt.src.{ext}")
    return {"translation": toy_data, "language_modeling": lm, "translation_multi_simple_epoch": toy_data}


def _train(data, task, tmp_path, *flags, on_load=None):
    fairseq_train([data[task], *TASKS[task], *RUN, "--save-dir", tmp_path, *flags], on_load=on_load)


def test_help_lists_the_plugins_group_with_a_stock_task():
    proc = run_cli("fairseq-train", ["--task", "translation", "--user-dir", USER_DIR, "--fp16", "--help"])
    assert f"\n{GROUP}:\n" in proc.stdout
    group = proc.stdout.split(f"\n{GROUP}:\n")[1]
    for flag in FLAGS:
        assert re.search(rf"^  {flag}\b", group, re.M), flag


def test_the_group_is_the_plugins_flags_and_no_flag_of_fairseq_has_their_names():
    """A flag of the same name in fairseq (its common flags, a task's config or add_args) would be
    dropped without a word (gen_parser_from_dataclass ignores the clash)."""
    import argparse

    from fairseq import options
    from fairseq.tasks import TASK_DATACLASS_REGISTRY, TASK_REGISTRY
    from fairseq_fp16.flags import PrecisionFlags
    from fairseq_fp16.patches import REGISTRY

    assert ["--" + f.replace("_", "-") for f in PrecisionFlags.__dataclass_fields__ if f != "_name"] == FLAGS
    REGISTRY.uninstall()
    try:
        clashes = [f for f in FLAGS if f in options.get_training_parser()._option_string_actions]
        for name, dc in TASK_DATACLASS_REGISTRY.items():
            clashes += [(name, f) for f in FLAGS if f[2:].replace("-", "_") in dc.__dataclass_fields__]
        for name, cls in TASK_REGISTRY.items():
            if name not in TASK_DATACLASS_REGISTRY:
                parser = argparse.ArgumentParser(conflict_handler="resolve")
                cls.add_args(parser)
                clashes += [(name, f) for f in FLAGS if f in parser._option_string_actions]
    finally:
        REGISTRY.install()
    assert clashes == []


@pytest.mark.parametrize("task", list(TASKS))
def test_the_flags_take_effect_under_any_task(data, tmp_path, task):
    """--fp32-modules (the task builds the model), --loss-scale (the optimizer reads the task's
    config) and --scale-trace (the diagnostics) under a task that does not declare them."""
    dtypes = {}

    def look(trainer, extra_state):
        dtypes.update((name, p.dtype) for name, p in trainer.model.named_parameters())

    trace = tmp_path / "trace.jsonl"
    _train(data, task, tmp_path, "--fp16", "--fp32-modules", r"decoder\.layers\.0\.fc1",
           "--loss-scale", "8", "--scale-trace", trace, "--max-update", "2", on_load=look)
    assert dtypes["decoder.layers.0.fc1.weight"] == torch.float32
    assert dtypes["decoder.layers.0.fc2.weight"] == torch.float16
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [(r["update"], r["loss_scale"]) for r in records] == [(1, 8.0), (2, 8.0)]


BAD = [
    (["--loss-scale-hysteresis", "0"], r"--loss-scale-hysteresis must be an integer >= 1"),
    (["--fp32-modules", "(bad"], r"--fp32-modules is not a valid regular expression: '\(bad'"),
    (["--scale-trace", "."], r"--scale-trace must name a file \(it is written as JSON lines\), got the "
                             r"directory '\.'"),
    (["--cuda-graphs", "--length-buckets", "4"],
     r"--cuda-graphs runs the compiled layers as CUDA graphs; add --compile-layers"),
]


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("flags,message", BAD, ids=[c[0][0][2:] for c in BAD])
def test_bad_values_are_refused_under_any_task(data, tmp_path, task, flags, message):
    with pytest.raises(ValueError, match=message):
        _train(data, task, tmp_path, "--fp16", *flags, "--max-update", "1")


@pytest.mark.parametrize("task", list(TASKS))
def test_a_bad_choice_is_refused_by_the_parser_under_any_task(data, tmp_path, task, capsys):
    with pytest.raises(SystemExit):
        _train(data, task, tmp_path, "--fp16", "--attention-path", "flash", "--max-update", "1")
    assert re.search(r"argument --attention-path: invalid choice: 'flash' \(choose from '?auto'?, "
                     r"'?torch'?, '?fairseq'?\)", capsys.readouterr().err)


def test_uninstalled_the_stock_parser_and_task_configs_know_no_plugin_flag(toy_data):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.tasks import TASK_DATACLASS_REGISTRY
    from fairseq.tasks.translation import TranslationConfig
    from fairseq_fp16.patches import REGISTRY
    from hydra.core.config_store import ConfigStore

    args = [str(toy_data), "--task", "translation", "--arch", "transformer", "--fused-loss", "off"]
    REGISTRY.uninstall()
    try:
        assert TASK_DATACLASS_REGISTRY["translation"] is TranslationConfig
        assert not hasattr(ConfigStore.instance().repo["task"]["translation.yaml"].node, "fused_loss")
        with pytest.raises(SystemExit):  # unrecognized arguments: --fused-loss off
            options.parse_args_and_arch(options.get_training_parser(), args)
    finally:
        REGISTRY.install()
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), args))
    assert cfg.task.fused_loss == "off" and cfg.task.loss_scale_hysteresis == 1
    assert ConfigStore.instance().repo["task"]["translation.yaml"].node.fused_loss == "auto"


def test_a_task_registered_after_the_plugin_gets_its_flags():
    from dataclasses import dataclass

    from fairseq.dataclass import FairseqDataclass
    from fairseq.tasks import TASK_CLASS_NAMES, TASK_DATACLASS_REGISTRY, TASK_REGISTRY, FairseqTask, register_task
    from fairseq_fp16.patches import REGISTRY
    from hydra.core.config_store import ConfigStore

    @dataclass
    class LaterConfig(FairseqDataclass):
        data: str = "x"

    class LaterTask(FairseqTask):
        pass

    try:
        register_task("fp16_test_later", dataclass=LaterConfig)(LaterTask)
        assert TASK_DATACLASS_REGISTRY["fp16_test_later"]().loss_scale_hysteresis == 1
        assert ConfigStore.instance().repo["task"]["fp16_test_later.yaml"].node.fused_loss == "auto"
        REGISTRY.uninstall()
        assert TASK_DATACLASS_REGISTRY["fp16_test_later"] is LaterConfig
        REGISTRY.install()
        assert "cuda_graphs" in TASK_DATACLASS_REGISTRY["fp16_test_later"].__dataclass_fields__
    finally:
        REGISTRY.install()
        TASK_REGISTRY.pop("fp16_test_later", None)
        TASK_DATACLASS_REGISTRY.pop("fp16_test_later", None)
        TASK_CLASS_NAMES.discard("LaterTask")
        ConfigStore.instance().repo["task"].pop("fp16_test_later.yaml", None)


HYDRA_CONFIG = """\
common: {{cpu: true, fp16: true, seed: 1, log_format: json, log_interval: 1}}
task: {{_name: translation, data: {data}, scale_trace: {trace}, loss_scale: "8"}}
model: {{_name: transformer, encoder_layers: 1, decoder_layers: 1, encoder_embed_dim: 32,
        decoder_embed_dim: 32, encoder_ffn_embed_dim: 64, decoder_ffn_embed_dim: 64,
        encoder_attention_heads: 2, decoder_attention_heads: 2}}
criterion: cross_entropy
optimizer: {{_name: adam}}
lr_scheduler: fixed
optimization: {{max_update: 2, lr: [0.001]}}
dataset: {{max_tokens: 1000, num_workers: 0, disable_validation: true}}
checkpoint: {{no_save: true, save_dir: {out}}}
"""


@pytest.mark.slow
def test_a_hydra_config_takes_the_plugins_flags_under_task(toy_data, tmp_path):
    """fairseq-hydra-train merges the task's section into its registered dataclass before it
    imports common.user_dir: python -m fairseq_fp16.hydra_train loads the plugin first."""
    trace = tmp_path / "trace.jsonl"
    (tmp_path / "run.yaml").write_text(HYDRA_CONFIG.format(data=toy_data, trace=trace, out=tmp_path))
    proc = subprocess.run([sys.executable, "-m", "fairseq_fp16.hydra_train", "--config-dir", str(tmp_path),
                           "--config-name", "run", f"hydra.run.dir={tmp_path}/hydra"],
                          capture_output=True, text=True, env=CLI_ENV, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [(r["update"], r["loss_scale"]) for r in records] == [(1, 8.0), (2, 8.0)]
