"""Resume what stock fairseq wrote: a checkpoint of an fp32 run with fairseq's adam, or of a
--fp16 run (FP16Optimizer: one flat fp32 parameter, its Adam moments and the loss scale), read
into the plugin's optimizer in fp32, fp16 or bf16 without --reset-optimizer."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from fairseq.optim.adam import Adam as FairseqAdamImpl

from conftest import train
from fairseq_fp16.core.adam import build_adam
from fairseq_fp16.core.loss_scaler import LossScaler
from fairseq_fp16.core.master_weights import MixedPrecisionOptimizer
from fairseq_fp16.optim.stock_state import import_stock_state

STOCK_UPDATES, MORE = 10, 16


def losses(recs):
    return {int(r["num_updates"]): r["loss"] for r in recs}


@pytest.fixture(scope="module")
def stock(toy_data, tmp_path_factory):
    """A stock fp32 run (fairseq's translation task and adam, no plugin) stopped at update 10,
    and the same run uninterrupted to update 16."""
    ck = tmp_path_factory.mktemp("stock")
    train(toy_data, ck, "--max-update", str(STOCK_UPDATES), user_dir=False)
    _, full = train(toy_data, tmp_path_factory.mktemp("stock_full"), "--max-update", str(MORE),
                    "--no-save", user_dir=False)
    return ck, losses(full)


def resume(toy_data, stock_dir, tmp_path, *flags):
    shutil.copytree(stock_dir, tmp_path, dirs_exist_ok=True)
    proc, recs = train(toy_data, tmp_path, "--max-update", str(MORE), *flags)
    return proc.stdout + proc.stderr, losses(recs)


@pytest.mark.slow
def test_stock_fp32_adam_resumes_with_the_plugin_exactly(toy_data, stock, tmp_path):
    log, got = resume(toy_data, stock[0], tmp_path, "--optimizer", "adam")
    assert "was written by stock fairseq (FairseqAdam)" in log
    assert "resumed from stock fairseq's FairseqAdam state: Adam moments and steps carried over" in log
    assert got == {u: stock[1][u] for u in range(STOCK_UPDATES + 1, MORE + 1)}


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--fp16"], ["--bf16", "--cpu-length-multiple", "1"]],
                         ids=["fp32", "fp16", "bf16"])  # the batches of the run it continues on AMX too
def test_stock_fp32_adam_resumes_into_fp16_adam_in_every_precision(toy_data, stock, tmp_path, flags):
    log, got = resume(toy_data, stock[0], tmp_path, *flags)
    assert "Optimizer does not match" not in log
    carried = "Adam moments and steps carried over" if not flags else \
        "Adam moments and steps, fp32 weights as masters carried over"
    assert carried in log
    ref = stock[1]
    tol = 1e-3 if not flags else 0.05
    assert sorted(got) == list(range(STOCK_UPDATES + 1, MORE + 1))
    assert all(abs(got[u] - ref[u]) < tol for u in got), (got, ref)


@pytest.mark.slow
def test_a_resume_mid_epoch_into_batches_of_padded_lengths_is_refused_naming_the_flag(toy_data, stock, tmp_path):
    # --max-tokens counts padded lengths: the stock run's epoch, cut from the lengths as they are,
    # would be cut into other batches, and fairseq skips the first 10 by position
    padded = ["--bf16", "--half-matmul", "native", "--cpu-length-multiple", "8"]
    shutil.copytree(stock[0], tmp_path, dirs_exist_ok=True)
    proc, recs = train(toy_data, tmp_path, "--max-update", str(MORE), *padded, check=False)
    assert proc.returncode != 0 and recs == []
    assert ("checkpoint_last.pt stopped 10 batches into an epoch whose batches counted the lengths as "
            "they are toward --max-tokens; this run counts lengths padded to a multiple of 8 and would "
            "train on other sentences than the run it continues. Pass --cpu-length-multiple 1 "
            "(half-precision runs) to resume it exactly, or --reset-dataloader") in proc.stderr
    proc, recs = train(toy_data, tmp_path, "--max-update", str(MORE), *padded, "--reset-dataloader")
    assert [int(r["num_updates"]) for r in recs] == list(range(STOCK_UPDATES + 1, MORE + 1))


@pytest.mark.slow
def test_a_stock_fp16_checkpoint_carries_its_flat_moments_and_loss_scale(toy_data, stock, tmp_path):
    """An FP16Optimizer state as fairseq lays it out (it needs CUDA to be written by fairseq
    itself): the fp32 run's Adam moments flattened in the trainer's parameter order into one
    parameter, half-precision model weights and a loss scale of 64."""
    shutil.copytree(stock[0], tmp_path, dirs_exist_ok=True)
    path = tmp_path / "checkpoint_last.pt"
    state = torch.load(path, weights_only=False)
    adam = state["last_optimizer_state"]
    order = [i for g in adam["param_groups"] for i in g["params"]]
    flat = {k: torch.cat([adam["state"][i][k].flatten() for i in order]) for k in ("exp_avg", "exp_avg_sq")}
    group = dict(adam["param_groups"][0], params=[0])
    state["last_optimizer_state"] = {"state": {0: {"step": adam["state"][order[0]]["step"], **flat}},
                                     "param_groups": [group], "loss_scale": 64.0}
    state["optimizer_history"][-1]["optimizer_name"] = "FP16Optimizer"
    state["model"] = {k: v.half() if v.is_floating_point() else v for k, v in state["model"].items()}
    torch.save(state, path)
    proc, recs = train(toy_data, tmp_path, "--max-update", str(MORE), "--fp16")
    log = proc.stdout + proc.stderr
    assert "resumed from stock fairseq's FP16Optimizer state: Adam moments and steps, loss scale 64 carried over" in log
    assert recs[0]["loss_scale"] == 64
    got, ref = losses(recs), stock[1]
    assert all(abs(got[u] - ref[u]) < 0.05 for u in got), (got, ref)
    # the history names each run's optimizer: stock fairseq's class, then the plugin's --optimizer
    history = torch.load(path, weights_only=False)["optimizer_history"]
    assert [h["optimizer_name"] for h in history] == ["FP16Optimizer", "FP16Adam (fairseq_fp16 fp16)"]


def test_flat_fp16_optimizer_moments_are_cut_back_into_the_parameters():
    torch.manual_seed(0)
    shapes = [(4, 3), (3,), (2, 2, 2)]
    params = [torch.nn.Parameter(torch.randn(s).half()) for s in shapes]
    flat = torch.nn.Parameter(torch.cat([p.detach().float().flatten() for p in params]))
    stock = FairseqAdamImpl([flat], lr=1e-2)  # FP16Optimizer's fp32_optimizer over its flat copy
    for _ in range(3):
        flat.grad = torch.randn_like(flat)
        stock.step()
    saved = dict(stock.state_dict(), loss_scale=128.0)
    ours = MixedPrecisionOptimizer(params, lambda ps: build_adam(ps, lr=1e-2, no_decay_params=""),
                                   LossScaler(128.0))
    converted = import_stock_state("FP16Optimizer", saved, ours.optimizer, ours.master_params, params)
    ours.optimizer.load_state_dict(converted)
    offset = 0
    for m, p in zip(ours.master_params, params):
        n = p.numel()
        st = ours.optimizer.state[m]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key], stock.state[flat][key][offset:offset + n].view(p.shape))
        assert float(st["step"]) == 3.0
        offset += n
    with pytest.raises(ValueError, match=r"the FairseqAdam state holds 1 parameters, the model 3"):
        import_stock_state("FairseqAdam", saved, ours.optimizer, ours.master_params, params)


@pytest.mark.slow
def test_an_exported_plugin_checkpoint_decodes_and_restarts_with_stock_fairseq(toy_data, tmp_path):
    """The other direction: export_fp32_checkpoint puts a half run's fp32 masters into the model;
    stock fairseq (no plugin) decodes it and trains on from those weights with a fresh optimizer
    (--reset-optimizer: it cannot build the plugin's optimizer). Stock fairseq 0.12 loads no
    checkpoint at all under torch >= 2.6's weights-only default; TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1
    is torch's own switch for that."""
    from conftest import BIN, ROOT, TINY_MODEL

    train(toy_data, tmp_path / "half", "--fp16", "--max-update", "5")
    exported = tmp_path / "fp32.pt"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "export_fp32_checkpoint.py"),
                    str(tmp_path / "half" / "checkpoint_last.pt"), str(exported)], check=True, capture_output=True)
    env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    gen = subprocess.run([str(BIN / "fairseq-generate"), str(toy_data), "--path", str(exported), "--task",
                          "translation", "--cpu", "--beam", "2", "--gen-subset", "test", "--max-tokens", "4000",
                          "--required-batch-size-multiple", "1"], capture_output=True, text=True, env=env)
    assert gen.returncode == 0 and sum(line.startswith("H-") for line in gen.stdout.splitlines()) == 100, gen.stderr[-2000:]
    cont = subprocess.run([str(BIN / "fairseq-train"), str(toy_data), *TINY_MODEL, "--task", "translation",
                           "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "1000", "--cpu",
                           "--num-workers", "0", "--max-update", "8", "--save-dir", str(tmp_path / "stock"),
                           "--restore-file", str(exported), "--reset-optimizer", "--log-format", "json",
                           "--log-interval", "1"], capture_output=True, text=True, env=env)
    assert cont.returncode in (0, -6), cont.stderr[-2000:]  # -6: stock's abort at exit (tests/test_clean_exit.py)
    assert '"num_updates": "8"' in cont.stdout + cont.stderr
