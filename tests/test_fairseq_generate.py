"""fairseq-generate on the plugin's checkpoints, in fp32, --fp16 and --bf16."""

import re

import pytest
import torch

import fairseq_fp16  # noqa: F401  (allow-lists argparse.Namespace for torch.load)
from conftest import USER_DIR, run_cli, train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fp16_checkpoint(toy_data, tmp_path_factory):
    save = tmp_path_factory.mktemp("gen16")
    train(toy_data, save, "--fp16", "--max-update", "400", "--log-interval", "50",
          "--lr", "1e-2", "--warmup-updates", "40", "--dropout", "0")
    return save / "checkpoint_last.pt"


def generate(data, ckpt, *extra, user_dir=True, task="translation_fp16"):
    args = [data, "--path", ckpt, "--cpu", "--beam", "2", "--max-tokens", "4000",
            "--gen-subset", "test", "--task", task, *extra,
            # fairseq-generate drops the last batch when it is not a multiple of
            # --required-batch-size-multiple (default 8): score every sentence.
            "--required-batch-size-multiple", "1"]
    if user_dir:
        args += ["--user-dir", USER_DIR]
    proc = run_cli("fairseq-generate", args, check=False)
    hyps = {}
    for line in proc.stdout.splitlines():
        if line.startswith("H-"):
            key, _, text = line.split("\t")
            hyps[int(key[2:])] = text
    bleu = re.search(r"BLEU4 = ([\d.]+)", proc.stdout)
    return proc, hyps, float(bleu.group(1)) if bleu else None


@pytest.mark.parametrize("flags", [[], ["--fp16"], ["--bf16"]])
def test_generate_decodes_fp16_checkpoint(toy_data, fp16_checkpoint, flags):
    proc, hyps, bleu = generate(toy_data, fp16_checkpoint, *flags)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(hyps) == 100
    assert bleu is not None and bleu > 20, bleu


def test_half_decoding_agrees_with_fp32(toy_data, fp16_checkpoint):
    _, ref, _ = generate(toy_data, fp16_checkpoint)
    for flag in ("--fp16", "--bf16"):
        _, hyps, _ = generate(toy_data, fp16_checkpoint, flag)
        same = sum(hyps[k] == ref[k] for k in ref)
        assert same >= 90, (flag, same)


def test_stock_checkpoint_loads_with_plugin_only(toy_data, tmp_path):
    """A stock fairseq fp32 checkpoint: torch's weights-only load fails without the plugin."""
    train(toy_data, tmp_path, "--max-update", "2", user_dir=False)
    ckpt = tmp_path / "checkpoint_last.pt"
    proc, _, _ = generate(toy_data, ckpt, task="translation", user_dir=False)
    assert proc.returncode != 0 and "Weights only load failed" in proc.stderr
    proc, hyps, _ = generate(toy_data, ckpt, task="translation")
    assert proc.returncode == 0 and len(hyps) == 100


class _Boom:
    """Unpickling this runs a shell command (what a malicious checkpoint would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_checkpoint_with_code_payload_is_refused_without_running_it(toy_data, fp16_checkpoint, tmp_path):
    state = torch.load(fp16_checkpoint, weights_only=True)
    marker = tmp_path / "PWNED_MARKER"
    state["extra_state"]["payload"] = _Boom(marker)
    bad = tmp_path / "bad.pt"
    torch.save(state, bad)
    proc, hyps, _ = generate(toy_data, bad, "--results-path", tmp_path / "res")
    assert proc.returncode != 0 and "Weights only load failed" in proc.stderr
    assert "unsupported GLOBAL posix.system" in proc.stderr
    assert re.search(r"fairseq_fp16: refused to load checkpoint \S+bad\.pt: it holds the pickled global "
                     r"posix\.system, outside the allow-list of fairseq checkpoints \(argparse\.Namespace\); "
                     r"weights-only loading stopped before running anything", proc.stderr), proc.stderr[-1500:]
    assert not marker.exists() and not hyps


def repeats_a_token(hyp):
    words = hyp.split()
    return len(set(words)) < len(words)


def test_no_repeat_ngram_size_blocks_repeats_on_the_cpu(toy_data, fp16_checkpoint):
    """Stock fairseq 0.12 off CUDA blocks no repeat (its fallback reads the buffer's padding; fairseq
    issue #5206; tests/core/test_ngram_block.py shows it on fairseq's blocker itself). With the
    plugin loaded every task's generator blocks them (many toy references repeat a word, so the
    model's outputs do too)."""
    _, plain, _ = generate(toy_data, fp16_checkpoint)
    assert sum(map(repeats_a_token, plain.values())) >= 30
    for task in ("translation_fp16", "translation"):
        proc, blocked, _ = generate(toy_data, fp16_checkpoint, "--no-repeat-ngram-size", "1", task=task)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert len(blocked) == 100 and not any(map(repeats_a_token, blocked.values())), task
        assert ("--no-repeat-ngram-size 1: repeats blocked by the plugin's NGramBlock (fairseq's fallback "
                "off its CUDA kernel blocks none)") in proc.stdout + proc.stderr


# --------------------------------------------------- scripts/export_fp32_checkpoint.py
SHARED_EMBEDDING = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
                    "decoder.output_projection.weight")


@pytest.fixture(scope="module")
def exported(fp16_checkpoint, tmp_path_factory):
    from fairseq_fp16_tools.checkpoints import export

    out = tmp_path_factory.mktemp("exported") / "fp32.pt"
    return out, export(fp16_checkpoint, out)


def test_export_writes_the_exact_masters_under_every_name(fp16_checkpoint, exported):
    out, summary = exported
    src = torch.load(fp16_checkpoint, weights_only=True)
    dst = torch.load(out, weights_only=True)
    masters = src["last_optimizer_state"]["master_params"]
    assert summary["precision"] == "fp16" and summary["replaced"] == len(masters) > 10
    # the shared table is one parameter and three state-dict names
    assert summary["names"] == summary["replaced"] + 2
    table = dst["model"][SHARED_EMBEDDING[0]]
    assert all(torch.equal(dst["model"][k], table) for k in SHARED_EMBEDDING)
    assert any(torch.equal(table, m) for m in masters.values())
    replaced = {k for k, v in dst["model"].items() if not torch.equal(v, src["model"][k])}
    assert set(SHARED_EMBEDDING) <= replaced and len(replaced) == summary["names"]
    for k, v in dst["model"].items():
        if k in replaced:  # its master, which rounds to the half model's weight
            assert v.dtype == torch.float32 and torch.equal(v.half().float(), src["model"][k]), k
            assert any(v.shape == m.shape and torch.equal(v, m) for m in masters.values()), k
        else:  # fp32 islands (LayerNorm) and buffers have no half copy: unchanged
            assert "layer_norm" in k or not k.endswith((".weight", ".bias")), k
    assert summary["changed"] == sum(int((dst["model"][k] != src["model"][k]).sum()) for k in replaced)
    assert summary["changed"] > 0.5 * sum(dst["model"][k].numel() for k in replaced)
    opt_src, opt_dst = src["last_optimizer_state"], dst["last_optimizer_state"]
    assert all(torch.equal(opt_dst["master_params"][i], m) for i, m in masters.items())
    assert opt_dst["scaler"] == opt_src["scaler"] and dst["extra_state"] == src["extra_state"]


def test_exported_checkpoint_decodes_and_resumes_as_the_original(toy_data, fp16_checkpoint, exported, tmp_path):
    out, _ = exported
    _, ref, bleu_ref = generate(toy_data, fp16_checkpoint)
    proc, hyps, bleu = generate(toy_data, out)
    assert proc.returncode == 0 and len(hyps) == 100, proc.stderr[-2000:]
    assert sum(hyps[k] == ref[k] for k in ref) >= 90 and abs(bleu - bleu_ref) < 3, (bleu, bleu_ref)
    # resuming: the half model takes the masters rounded (IN's weights), the optimizer the masters
    losses = []
    for ckpt in (fp16_checkpoint, out):
        _, records = train(toy_data, tmp_path / ckpt.stem, "--fp16", "--restore-file", ckpt, "--max-update",
                           "405", "--lr", "1e-2", "--warmup-updates", "40", "--dropout", "0")
        losses.append([(r["num_updates"], r["loss"], r["loss_scale"]) for r in records])
    assert len(losses[0]) == 5 and losses[0] == losses[1]


def test_export_refuses_a_checkpoint_without_masters_or_with_foreign_ones(toy_data, fp16_checkpoint, tmp_path):
    from fairseq_fp16_tools.checkpoints import export
    from fairseq_fp16_tools.checkpoints import export_main as main

    train(toy_data, tmp_path / "fp32", "--max-update", "2")
    with pytest.raises(ValueError, match=r"fp32/checkpoint_last\.pt holds no fp32 master weights "
                                         r"\(precision: fp32\): only a --fp16 or --bf16 run"):
        export(tmp_path / "fp32" / "checkpoint_last.pt", tmp_path / "x.pt")
    state = torch.load(fp16_checkpoint, weights_only=True)
    masters = state["last_optimizer_state"]["master_params"]
    # two masters of the same shape swapped: each fits a parameter, neither fits its own
    i, j = next((i, j) for i in masters for j in masters if i < j and masters[i].shape == masters[j].shape)
    masters[i], masters[j] = masters[j], masters[i]
    torch.save(state, tmp_path / "swapped.pt")
    with pytest.raises(ValueError, match=rf"swapped\.pt: the fp32 master of parameter {i} does not round to "
                                         r"the model's weight '[\w.]+': the masters do not fit this model"):
        export(tmp_path / "swapped.pt", tmp_path / "x.pt")
    del state["last_optimizer_state"]
    torch.save(state, tmp_path / "bare.pt")
    with pytest.raises(SystemExit, match=r"export_fp32_checkpoint: \S+bare\.pt holds no optimizer state "
                                         r"\(saved with --no-save-optimizer-state\?\)"):
        main([str(tmp_path / "bare.pt"), str(tmp_path / "x.pt")])
    assert not (tmp_path / "x.pt").exists()
    (tmp_path / "notes.pt").write_text("not a checkpoint\n")
    with pytest.raises(SystemExit, match=r"^export_fp32_checkpoint: \S+notes\.pt is not a readable checkpoint "
                                         r"\(UnpicklingError: [^\n]*\): the file is truncated or damaged, or "
                                         r"was not written by fairseq$"):
        main([str(tmp_path / "notes.pt"), str(tmp_path / "x.pt")])
    assert not (tmp_path / "x.pt").exists()
