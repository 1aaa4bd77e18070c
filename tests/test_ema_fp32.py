"""--ema-fp32 in a half run: the trainer's EMA (fairseq_fp16/ema.py's MastersEMA) averages the fp32
masters, without recording an autograd graph in its tensors and with tied weights read under
every key."""

import resource

import torch
from omegaconf import OmegaConf

from fairseq_fp16.patches import trainer as trainer_patch


class _Tied(torch.nn.Module):
    """200 half weights, the first under a second key too (shared embeddings)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(64, 64).half()) for _ in range(200))
        self.tied = self.layers[0]


class _Optimizer:
    """What the EMA reads of the plugin's optimizer: ``masters_by_param()``."""

    def __init__(self, model):
        self.masters = {id(p): torch.nn.Parameter(p.detach().float() + 1e-3) for p in model.parameters()}

    def masters_by_param(self):
        return self.masters


def _ema(model, opt):
    cfg = OmegaConf.create({"ema_decay": 0.9, "ema_fp32": True, "ema_seed_model": None,
                            "ema_update_freq": 1, "ema_start_update": 0})
    ema = trainer_patch._build_ema(model, cfg, None)  # what the patched trainer builds
    ema.follow(opt)
    return ema


def test_the_ema_of_the_masters_records_no_graph_and_keeps_its_memory():
    torch.manual_seed(0)
    model = _Tied()
    opt = _Optimizer(model)
    ema = _ema(model, opt)

    def steps(n):
        for _ in range(n):
            with torch.no_grad():
                for m in opt.masters.values():
                    m.add_(1e-3)
            ema.step(model)

    steps(50)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    steps(300)
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert [k for k, t in ema.fp32_params.items() if t.requires_grad or t.grad_fn is not None] == []
    # the leak was about 330 KB an update for 200 tensors (100 MB here)
    assert grown_kb < 20_000, f"peak RSS grew {grown_kb} KB over 300 EMA updates"


def test_a_tied_weight_averages_its_master_under_every_key():
    model = _Tied()
    opt = _Optimizer(model)
    ema = _ema(model, opt)
    ema._set_decay(0.0)  # the EMA is the latest weights
    ema.step(model)
    master = opt.masters[id(model.layers[0])]
    assert torch.equal(ema.fp32_params["layers.0"], master)
    assert torch.equal(ema.fp32_params["tied"], master)
