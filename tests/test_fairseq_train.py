"""Real fairseq-train runs on a tiny corpus: fp32, fp16, bf16, scaling, resume."""

import json

import pytest
import torch

from conftest import USER_DIR, run_cli, train

pytestmark = pytest.mark.slow


def losses(records):
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def runs(toy_data, tmp_path_factory):
    out = {}
    # fp32-accumulate explicitly: the same numerics on every CPU, whatever its units
    acc = ["--half-matmul", "fp32-accumulate"]
    for name, flags in {"fp32": [], "fp16": ["--fp16", *acc], "bf16": ["--bf16", *acc]}.items():
        _, recs = train(toy_data, tmp_path_factory.mktemp(name), *flags, "--max-update", "40")
        out[name] = recs
    return out


# Pinned on this CPU (torch 2.13.0, fairseq-fixed 0.12.3.1): loss at updates 1, 20, 40.
# The tiny model's half-precision error stays below the log's 3 decimals.
PINNED = {
    "fp32": (7.186, 5.891, 5.493),
    "fp16": (7.186, 5.891, 5.493),
    "bf16": (7.187, 5.891, 5.493),
}


@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16"])
def test_loss_falls_and_matches_pinned(runs, name):
    recs = runs[name]
    assert [r["num_updates"] for r in recs] == list(range(1, 41))
    ls = losses(recs)
    assert ls[-1] < ls[0] - 1.0, ls
    got = (ls[0], ls[19], ls[39])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(PINNED[name]), rtol=0, atol=0.01)


def test_mixed_precision_tracks_fp32(runs):
    for name in ("fp16", "bf16"):
        for a, b in zip(losses(runs["fp32"]), losses(runs[name])):
            assert abs(a - b) < 0.1, (name, a, b)


def test_compile_step_trains_as_the_eager_step(runs, toy_data, tmp_path):
    """--compile-step: the update compiled from the half gradients; the losses are the eager
    step's within the log's rounding, and fp32 (one fused loop already) runs as before."""
    _, recs = train(toy_data, tmp_path / "bf16", "--bf16", "--half-matmul", "fp32-accumulate",
                    "--compile-step", "--max-update", "40")
    assert json.loads((tmp_path / "bf16" / "run_info.json").read_text())["compile_step"] is True
    for a, b in zip(losses(runs["bf16"]), losses(recs), strict=True):
        assert abs(a - b) <= 0.002, (a, b)
    _, recs = train(toy_data, tmp_path / "fp32", "--compile-step", "--max-update", "40")
    assert json.loads((tmp_path / "fp32" / "run_info.json").read_text())["compile_step"] is False
    assert losses(recs) == losses(runs["fp32"])


def test_compile_step_with_another_optimizer_stops_naming_the_flag(toy_data, tmp_path):
    proc, _ = train(toy_data, tmp_path, "--bf16", "--compile-step", "--optimizer", "adam",
                    "--max-update", "1", check=False)
    assert proc.returncode != 0
    assert "--compile-step compiles torch's fused AdamW update: use --optimizer fp16_adam" in proc.stderr


def test_scale_and_skips_are_logged(runs):
    assert all(r["loss_scale"] == 128 and r["skipped"] == 0 for r in runs["fp16"])
    assert all(r["loss_scale"] == 1 for r in runs["bf16"])
    assert "loss_scale" not in runs["fp32"][0]


def test_static_loss_scale_stays(toy_data, tmp_path):
    _, recs = train(toy_data, tmp_path, "--fp16", "--loss-scale", "128", "--fp16-scale-window", "2",
                    "--max-update", "8")
    assert [r["loss_scale"] for r in recs] == [128.0] * 8


def test_dynamic_scale_grows_backs_off_and_skips(toy_data, tmp_path):
    proc, recs = train(toy_data, tmp_path, "--fp16", "--fp16-init-scale", "1048576",
                       "--fp16-scale-window", "4", "--max-update", "10")
    text = proc.stdout + proc.stderr
    assert "gradient overflow detected, ignoring gradient, setting loss scale to: 524288" in text
    skipped = recs[-1]["skipped"]
    assert skipped >= 1
    # 2**20 halves once per overflow until the gradients fit, then grows every 4 updates
    first = recs[0]["loss_scale"]
    assert first == 2.0 ** (20 - skipped) or first < 2.0**20
    assert [r["num_updates"] for r in recs] == list(range(1, 11))
    scales = [r["loss_scale"] for r in recs]
    assert any(b == 2 * a for a, b in zip(scales, scales[1:])), scales


def test_hysteresis_delays_back_off(toy_data, tmp_path):
    proc, recs = train(toy_data, tmp_path, "--fp16", "--fp16-init-scale", "1048576",
                       "--loss-scale-hysteresis", "2", "--max-update", "3")
    notes = [l for l in (proc.stdout + proc.stderr).splitlines() if "gradient overflow detected" in l]
    # two overflows per halving: the first note still says 2**20
    assert notes[0].endswith("setting loss scale to: 1048576")
    assert notes[1].endswith("setting loss scale to: 524288")


def _resume_flags(extra):
    return ["--fp16", "--fp16-init-scale", "4096", "--fp16-scale-window", "3", *extra]


def test_resume_continues_like_an_uninterrupted_run(toy_data, tmp_path):
    _, full = train(toy_data, tmp_path / "full", *_resume_flags(["--max-update", "24"]))
    _, first = train(toy_data, tmp_path / "cut", *_resume_flags(["--max-update", "12"]))
    _, rest = train(toy_data, tmp_path / "cut", *_resume_flags(["--max-update", "24"]))
    assert [r["num_updates"] for r in rest] == list(range(13, 25))
    for a, b in zip(full[12:], rest):
        assert a["loss"] == pytest.approx(b["loss"], abs=2e-3)
        assert a["loss_scale"] == b["loss_scale"]
        assert a["skipped"] == b["skipped"]
    # the scale moved (grew, overflowed, backed off) on both sides of the cut
    assert len({r["loss_scale"] for r in full[:12]}) > 1
    assert len({r["loss_scale"] for r in full[12:]}) > 1


# bf16 on AMX pads batch lengths, which --max-tokens counts: resumed inside the epoch as fp16 cut
# it (test_stock_resume.py has the refusal without --cpu-length-multiple 1)
@pytest.mark.parametrize("first,second", [([], ["--fp16"]), (["--fp16"], []),
                                          (["--fp16"], ["--bf16", "--cpu-length-multiple", "1"])])
def test_checkpoint_changes_precision_without_reset_optimizer(toy_data, tmp_path, first, second):
    train(toy_data, tmp_path, *first, "--max-update", "6")
    proc, recs = train(toy_data, tmp_path, *second, "--max-update", "10")
    assert "Loaded checkpoint" in proc.stdout + proc.stderr
    assert [r["num_updates"] for r in recs] == [7, 8, 9, 10]


def test_fp32_accumulate_tracks_native_fp16(toy_data, tmp_path):
    """50 updates: the CPU fp32-accumulate mode against torch's native fp16 kernels."""
    proc, acc = train(toy_data, tmp_path / "acc", "--fp16", "--half-matmul", "fp32-accumulate",
                      "--max-update", "50", "--no-save")
    assert "CPU fp16 matrix products: fp32 accumulation, rounded to half" in proc.stdout + proc.stderr
    _, native = train(toy_data, tmp_path / "native", "--fp16", "--half-matmul", "native",
                      "--max-update", "50", "--no-save")
    assert len(acc) == len(native) == 50
    for a, b in zip(losses(acc), losses(native)):
        assert a == pytest.approx(b, abs=0.02)
    assert losses(acc)[-1] < losses(acc)[0] - 1.0


# fairseq's recurrent and convolutional models: an LSTM decoder steps an LSTMCell, fconv's
# layers are ConvTBC (torch.conv_tbc) with weight normalisation
OTHER_ARCHS = {
    "lstm": ["--arch", "lstm", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
             "--decoder-out-embed-dim", "32", "--encoder-hidden-size", "32", "--decoder-hidden-size", "32"],
    "fconv": ["--arch", "fconv", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
              "--decoder-out-embed-dim", "32", "--encoder-layers", "[(32, 3)] * 2",
              "--decoder-layers", "[(32, 3)] * 2"],
}


@pytest.mark.parametrize("arch", sorted(OTHER_ARCHS))
def test_lstm_and_fconv_models_train_and_generate_in_fp16(toy_data, tmp_path, arch):
    """fp16 with fp32 accumulation tracks fp32 for 30 updates; the first training and generation
    steps find no product that escaped to a native half kernel."""
    model = OTHER_ARCHS[arch]
    _, ref = train(toy_data, tmp_path / "fp32", "--max-update", "30", "--no-save", model=model)
    div = tmp_path / "divergence.jsonl"  # fconv's weight_norm modules survive the fp32 copy
    proc, half = train(toy_data, tmp_path / "fp16", "--fp16", "--half-matmul", "fp32-accumulate",
                       "--max-update", "30", "--precision-divergence-interval", "15",
                       "--precision-divergence", div, model=model)
    records = [json.loads(line) for line in div.read_text().splitlines()]
    assert [r["update"] for r in records] == [0, 15]
    assert all(0 < max(r["modules"].values()) < 0.01 for r in records)
    assert "--half-matmul: every half-precision matrix product of the first training step " \
           "accumulated in fp32" in proc.stdout + proc.stderr
    assert len(ref) == len(half) == 30
    for a, b in zip(losses(ref), losses(half)):
        assert a == pytest.approx(b, abs=0.02)
    assert losses(half)[-1] < losses(half)[0] - 0.5  # 6.45 -> 5.60 (lstm), 6.48 -> 5.71 (fconv)
    gen = run_cli("fairseq-generate", [
        toy_data, "--path", tmp_path / "fp16" / "checkpoint_last.pt", "--cpu", "--fp16",
        "--half-matmul", "fp32-accumulate", "--beam", "2", "--max-len-b", "20", "--gen-subset", "test",
        "--task", "translation_fp16", "--user-dir", USER_DIR, "--required-batch-size-multiple", "1"])
    assert "--half-matmul: every half-precision matrix product of the first generation step " \
           "accumulated in fp32" in gen.stdout + gen.stderr
    assert sum(line.startswith("H-") for line in gen.stdout.splitlines()) == 100


def test_the_whole_encoder_in_fp32_trains(toy_data, tmp_path):
    # the encoder's dict output is cast back to half at the island's edge for the decoder
    proc, recs = train(toy_data, tmp_path, "--fp16", "--fp32-modules", "^encoder$", "--max-update", "3")
    assert "fp32 modules (--fp32-modules): encoder" in proc.stdout + proc.stderr
    assert [r["num_updates"] for r in recs] == [1, 2, 3] and all(r["skipped"] == 0 for r in recs)


def test_ema_fp32_averages_the_fp32_masters(toy_data, tmp_path):
    # with decay 0 the EMA is the latest weights: in a half run, the masters, not their rounding
    train(toy_data, tmp_path, "--fp16", "--store-ema", "--ema-fp32", "--ema-decay", "0", "--max-update", "3")
    state = torch.load(tmp_path / "checkpoint_last.pt", weights_only=False)
    opt = state["last_optimizer_state"]
    ema = state["extra_state"]["ema_fp32_params"]
    for i, name in opt["master_names"].items():
        master = opt["master_params"][i]
        assert torch.equal(ema[name], master), name
    assert any(not torch.equal(m.half().float(), m) for m in opt["master_params"].values())
    # the shared embeddings' other keys average the same master; nothing was saved tracking grads
    shared = dict(zip(opt["master_names"].values(), opt["master_params"].values()))["encoder.embed_tokens.weight"]
    for key in ("decoder.embed_tokens.weight", "decoder.output_projection.weight"):
        assert torch.equal(ema[key], shared), key
    assert [k for k, t in ema.items() if t.requires_grad] == []
