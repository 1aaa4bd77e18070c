"""--cpu-length-multiple: which runs get padded batch lengths, and that padding changes nothing else.

The task is built the way fairseq-train builds it (parsed flags, ``tasks.setup_task``), with the
CPU's /proc/cpuinfo flags replaced, so each machine type's default is checked on any machine.
"""

import os

import pytest
import torch

from conftest import TINY_MODEL, TRAIN, USER_DIR, train
from fairseq_fp16.core import half_matmul
from fairseq_fp16.core.cpu_kernel_cache import CACHE_ENV_VARS

AMX_CPU = {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16"}  # the AMX Xeon here
BF16_CPU = {"avx512f", "avx512_bf16"}  # the AVX512-BF16 EPYC: bf16 units, no AMX


def build_task(data, flags, cpu_flags, monkeypatch, model=True):
    """The translation_fp16 task with its model built (``model``) and its valid split loaded,
    in fairseq-train's order; returns (task, kernel-cache env)."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    monkeypatch.setattr(half_matmul, "_cpu_flags", lambda: frozenset(cpu_flags))
    for var in CACHE_ENV_VARS:  # unset for the task; monkeypatch restores them afterwards
        monkeypatch.setenv(var, "unset")
        monkeypatch.delenv(var)
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser, [str(data), *TINY_MODEL, *TRAIN, "--user-dir", USER_DIR, "--save-dir", "unused", *flags])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    if model:
        task.build_model(cfg.model)
    env = {var: os.environ.get(var) for var in CACHE_ENV_VARS}
    task.load_dataset("valid")
    return task, env


def batch_lengths(task):
    """(source, target) lengths of every batch of 8 valid sentences, as collated."""
    ds = task.dataset("valid")
    out = []
    for start in range(0, len(ds), 8):
        b = ds.collater([ds[i] for i in range(start, min(start + 8, len(ds)))])
        out.append((b["net_input"]["src_tokens"].size(1), b["target"].size(1)))
    return out


CASES = [
    # flags, CPU, multiple the lengths must be padded to (1: not padded), kernel-cache capacity
    (["--bf16", "--half-matmul", "native"], AMX_CPU, 8, "1024"),
    (["--bf16", "--half-matmul", "native"], BF16_CPU, 1, "64"),
    (["--fp16", "--half-matmul", "native"], AMX_CPU, 1, "64"),  # AVX512-FP16 but no AMX-FP16
    (["--fp16", "--half-matmul", "native"], AMX_CPU | {"amx_fp16"}, 8, "1024"),
    (["--bf16", "--half-matmul", "fp32-accumulate"], AMX_CPU, 1, None),  # fp32 products: no oneDNN
    ([], AMX_CPU, 1, None),  # fp32 runs are never padded by the flag
    (["--bf16", "--half-matmul", "native", "--cpu-length-multiple", "1"], AMX_CPU, 1, "64"),
    (["--bf16", "--half-matmul", "native", "--cpu-length-multiple", "16"], BF16_CPU, 16, "1024"),
    (["--bf16", "--half-matmul", "native", "--cpu-kernel-cache", "32"], AMX_CPU, 8, "32"),
    (["--bf16", "--half-matmul", "native", "--required-seq-len-multiple", "4"], AMX_CPU, 4, "1024"),
    # the tiny model's ~20 k linear weights: 1,000 tokens a batch are ~0.02 G multiply-adds,
    # 4 M tokens ~90 G, past the 32 G from which AMX runs faster unpadded
    (["--bf16", "--half-matmul", "native", "--max-tokens", "4000000"], AMX_CPU, 1, "64"),
    (["--bf16", "--half-matmul", "native", "--max-tokens", "1000000"], AMX_CPU, 8, "1024"),
    (["--bf16", "--half-matmul", "native", "--max-tokens", "4000000", "--cpu-length-multiple", "8"],
     AMX_CPU, 8, "1024"),
]


@pytest.mark.parametrize("flags,cpu,multiple,cache", CASES,
                         ids=[" ".join(f) + (" amx" if "amx_bf16" in c else "") for f, c, _, _ in CASES])
def test_lengths_are_padded_where_the_half_products_run_on_amx(toy_data, monkeypatch, flags, cpu,
                                                               multiple, cache):
    task, env = build_task(toy_data, flags, cpu, monkeypatch)
    lengths = batch_lengths(task)
    assert task.dataset("valid").pad_to_multiple == multiple
    # the automatic padding is the task's, not a setting: the cfg that checkpoints save keeps the user's
    assert task.cfg.required_seq_len_multiple == (4 if "--required-seq-len-multiple" in flags else 1)
    if multiple > 1:
        assert all(s % multiple == 0 and t % multiple == 0 for s, t in lengths), lengths
    else:  # the toy corpus's lengths vary: unpadded batches include lengths of every residue
        assert any(s % 8 for s, _ in lengths) and any(t % 8 for _, t in lengths), lengths
    assert env == {var: cache for var in CACHE_ENV_VARS}


def test_a_dataset_loaded_before_any_model_is_padded_on_amx_whatever_max_tokens(toy_data, monkeypatch):
    task, env = build_task(toy_data, ["--bf16", "--half-matmul", "native", "--max-tokens", "4000000"],
                           AMX_CPU, monkeypatch, model=False)
    assert task.dataset("valid").pad_to_multiple == 8 and task.length_multiple == 8
    assert os.environ.get(CACHE_ENV_VARS[0]) == "1024"
    task.fit_cpu_shapes(torch.nn.Linear(10**5, 10**3, device="meta"))  # 400 T: decided already
    assert task.length_multiple == 8


def test_generation_gets_the_batch_without_the_padded_columns(toy_data, monkeypatch):
    from fairseq_fp16.tasks.translation_fp16 import drop_pad_columns

    padded, _ = build_task(toy_data, ["--bf16", "--half-matmul", "native"], AMX_CPU, monkeypatch)
    plain, _ = build_task(toy_data, ["--bf16", "--half-matmul", "native", "--cpu-length-multiple", "1"],
                          AMX_CPU, monkeypatch)
    ds_padded, ds_plain = padded.dataset("valid"), plain.dataset("valid")
    pad = padded.source_dictionary.pad()

    class Recorder:  # a generator that returns the source it was given
        def generate(self, models, sample, **kwargs):
            return sample["net_input"]["src_tokens"]

    trimmed = 0
    for start in range(0, len(ds_plain), 8):
        idx = range(start, min(start + 8, len(ds_plain)))
        a, b = ds_padded.collater([ds_padded[i] for i in idx]), ds_plain.collater([ds_plain[i] for i in idx])
        trimmed += a["net_input"]["src_tokens"].size(1) != b["net_input"]["src_tokens"].size(1)
        # the beam's length limit counts source columns: generation sees the unpadded batch, exactly
        assert torch.equal(padded.inference_step(Recorder(), [], a), b["net_input"]["src_tokens"])
        assert torch.equal(drop_pad_columns(b, pad)["net_input"]["src_tokens"], b["net_input"]["src_tokens"])
    assert trimmed > 0


def test_padded_batches_stay_within_max_tokens(toy_data, monkeypatch):
    flags = ["--bf16", "--half-matmul", "native"]
    padded, _ = build_task(toy_data, flags, AMX_CPU, monkeypatch)
    plain, _ = build_task(toy_data, [*flags, "--cpu-length-multiple", "1"], AMX_CPU, monkeypatch)
    shapes = {}
    for name, task in (("padded", padded), ("plain", plain)):
        ds = task.dataset("valid")
        batches = ds.batch_by_size(ds.ordered_indices(), max_tokens=120)
        collated = [ds.collater([ds[i] for i in b]) for b in batches]
        shapes[name] = [(b["target"].size(0), b["net_input"]["src_tokens"].size(1), b["target"].size(1))
                        for b in collated]
    # every padded batch holds at most --max-tokens positions, source and target
    assert all(n * max(s, t) <= 120 for n, s, t in shapes["padded"]), shapes["padded"]
    # counted by their own lengths, as fairseq counts them, some batches of the same sentences
    # padded to 8 would have held more
    assert len(shapes["padded"]) > len(shapes["plain"])
    assert any(n * -(-max(s, t) // 8) * 8 > 120 for n, s, t in shapes["plain"])


def test_a_padded_run_resumed_inside_its_epoch_continues_as_uninterrupted(toy_data, tmp_path):
    from fairseq import checkpoint_utils

    from fairseq_fp16.tasks.translation_fp16 import BATCH_LENGTHS_KEY

    padded = ["--bf16", "--half-matmul", "native", "--cpu-length-multiple", "8", "--dropout", "0"]
    _, full = train(toy_data, tmp_path / "full", *padded, "--max-update", "8", "--no-save")
    train(toy_data, tmp_path / "cut", *padded, "--max-update", "4")
    state = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "cut" / "checkpoint_last.pt"))
    assert state["extra_state"][BATCH_LENGTHS_KEY] == 8
    assert state["extra_state"]["train_iterator"]["iterations_in_epoch"] == 4  # inside the epoch
    _, rest = train(toy_data, tmp_path / "cut", *padded, "--max-update", "8")
    assert [r["num_updates"] for r in rest] == [5, 6, 7, 8]
    # the batches of the uninterrupted run (other batches: losses 0.1-0.5 bits apart)
    assert [r["loss"] for r in rest] == pytest.approx([r["loss"] for r in full[4:]], abs=2e-3)


def test_padded_lengths_leave_the_losses_as_they_were(toy_data, tmp_path):
    # no dropout, batches of 8 sentences whatever the padding: padding adds masked positions and
    # nothing else, so the logged losses and gradient norms agree (measured: equal to all three
    # logged decimals over 4 updates)
    runs = {}
    for multiple in ("8", "1"):
        proc, recs = train(toy_data, tmp_path / multiple, "--bf16", "--half-matmul", "native", "--dropout", "0",
                           "--cpu-length-multiple", multiple, "--max-update", "4", "--batch-size", "8")
        runs[multiple] = [(float(r["loss"]), float(r["gnorm"])) for r in recs]
        said = "CPU batch lengths: padded to a multiple of 8 (--cpu-length-multiple 8; the padding is masked)"
        assert (said in proc.stdout + proc.stderr) == (multiple == "8")
    assert len(runs["8"]) == 4
    torch.testing.assert_close(runs["8"], runs["1"], atol=2e-3, rtol=0)
    # the checkpoint's cfg does not carry the padding as if the user had asked for it
    from fairseq import checkpoint_utils

    state = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "8" / "checkpoint_last.pt"))
    assert state["cfg"]["task"]["required_seq_len_multiple"] == 1
