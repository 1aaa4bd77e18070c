"""The reference implementations' own scenarios as the specification.

fairseq's tests/test_fp16_optimizer.py (its FP16Optimizer on a one-weight linear model, with
fairseq's own test configuration: groups ``optimization``, ``optimizer`` and ``common`` only)
run through the plugin's optimizer wrapper, with fairseq's ``adam`` and with ``fp16_adam``,
on the CPU and, where there is one, a GPU. The plugin gives the same loss, gradient norm,
half weights, fp32 masters and loss scale. Where it deliberately differs, a test below says so:
``--memory-efficient-fp16`` is refused with fp16_adam instead of training without masters.
"""

import pytest
import torch
from omegaconf import OmegaConf

import fairseq_fp16  # noqa: F401  (registers fp16_adam)
from conftest import plugin_optimizer

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def fairseq_test_config(optimizer):
    """tests/test_fp16_optimizer.py's configuration, as fairseq writes it."""
    return OmegaConf.create({
        "optimization": {"lr": [0.1]},
        "optimizer": {"_name": optimizer, "lr": [0.1], "adam_betas": "(0.9, 0.999)", "adam_eps": 1e-8,
                      "weight_decay": 0.0},
        "common": {"fp16_init_scale": 1, "fp16_scale_window": 1, "fp16_scale_tolerance": 1,
                   "threshold_loss_scale": 1, "min_loss_scale": 1e-4, "tpu": False},
    })


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["adam", "fp16_adam"])
def test_fairseqs_fp16_optimizer_scenario(device, optimizer):
    x = torch.tensor([2.0], device=device).half()
    target = torch.tensor([2.0 * 3.0 + 5.0 + 1.0], device=device).half()
    model = torch.nn.Linear(1, 1)
    model.weight.data, model.bias.data = torch.tensor([[3.0]]), torch.tensor([5.0])
    model.to(device).half()
    opt = plugin_optimizer(fairseq_test_config(optimizer), list(model.parameters()), "fp16")

    opt.zero_grad()
    loss = torch.nn.L1Loss()(model(x), target)
    opt.backward(loss)
    assert loss.item() == 1.0
    assert round(opt.clip_grad_norm(0).item(), 4) == 2.2361
    opt.step()
    assert model.weight.item() == torch.tensor(3.0996, dtype=torch.float16).item()
    assert model.bias.item() == torch.tensor(5.1016, dtype=torch.float16).item()
    assert opt.scaler.loss_scale.item() == 2.0  # one clean update, window 1
    masters = torch.cat([m.detach().flatten() for m in opt.fp32_params])
    torch.testing.assert_close(masters.cpu(), torch.tensor([3.1, 5.1]), rtol=0, atol=1e-6)


def test_memory_efficient_fp16_with_fp16_adam_is_refused_naming_the_flags(toy_data, tmp_path):
    from conftest import train

    proc, _ = train(toy_data, tmp_path, "--fp16", "--memory-efficient-fp16", "--max-update", "1", check=False)
    assert proc.returncode != 0
    assert ("--memory-efficient-fp16 keeps no fp32 master weights, and --optimizer fp16_adam updates fp32 "
            "masters: use --fp16 alone") in proc.stderr


def test_the_default_scale_window_follows_a_per_epoch_update_freq():
    cfg = fairseq_test_config("adam")
    cfg.common.fp16_scale_window = None
    cfg.optimization.update_freq = [1, 4]
    cfg.distributed_training = {"distributed_world_size": 2}
    model = torch.nn.Linear(2, 2).half()
    opt = plugin_optimizer(cfg, list(model.parameters()), "fp16")
    assert opt.loss_scaler.scale_window == 2**14 // 2  # fairseq's 2**14 / world / update-freq
    opt.begin_epoch(2)
    assert opt.loss_scaler.scale_window == 2**14 // 8
    opt.begin_epoch(5)  # past the list: its last entry
    assert opt.loss_scaler.scale_window == 2**14 // 8


def test_bf16_dynamic_scaling_has_a_ceiling():
    cfg = fairseq_test_config("adam")
    cfg.task = {"loss_scale": "0"}
    opt = plugin_optimizer(cfg, list(torch.nn.Linear(2, 2).bfloat16().parameters()), "bf16")
    assert opt.loss_scaler.dynamic and opt.loss_scaler.max_scale == 2.0**24


def test_the_scale_traces_update_count_continues_after_a_resume(tmp_path):
    cfg = fairseq_test_config("adam")
    cfg.task = {"scale_trace": str(tmp_path / "trace.jsonl")}
    cfg.checkpoint = {"save_dir": str(tmp_path)}
    model = torch.nn.Linear(2, 2).half()
    opt = plugin_optimizer(cfg, list(model.parameters()), "fp16")
    for _ in range(3):
        opt.zero_grad()
        opt.backward(model(torch.ones(2).half()).float().sum())
        opt.clip_grad_norm(0)
        opt.step()
    resumed = plugin_optimizer(cfg, list(model.parameters()), "fp16")
    resumed.load_state_dict(opt.state_dict())
    assert resumed.diagnostics.attempt == opt.diagnostics.attempt == 3


def test_the_wrapper_takes_the_runs_precision_not_a_name():
    """The precision is parsed once, from the run's flags (Precision.from_cfg); a name would be
    parsed again apart from them (its --loss-scale unread)."""
    from fairseq_fp16.optim.mixed_precision import MixedPrecisionFairseqOptimizer

    params = list(torch.nn.Linear(2, 2).half().parameters())
    with pytest.raises(TypeError, match=r"precision must be a fairseq_fp16\.precision\.Precision, got 'fp16'"):
        MixedPrecisionFairseqOptimizer(fairseq_test_config("adam"), params, "fp16")
