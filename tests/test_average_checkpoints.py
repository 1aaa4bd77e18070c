"""scripts/average_checkpoints.py: a half run's checkpoints averaged from their fp32 masters."""

import json

import pytest
import torch

import fairseq_fp16  # noqa: F401  (allow-lists fairseq's globals for torch.load)
from conftest import train
from test_fairseq_generate import SHARED_EMBEDDING, generate

pytestmark = pytest.mark.slow

INTERVALS = ["--save-interval-updates", "100", "--keep-interval-updates", "3"]


@pytest.fixture(scope="module")
def fp16_run(toy_data, tmp_path_factory):
    save = tmp_path_factory.mktemp("avg16")
    train(toy_data, save, "--fp16", "--max-update", "400", "--log-interval", "50",
          "--lr", "1e-2", "--warmup-updates", "40", "--dropout", "0", *INTERVALS)
    return save


def load(path):
    return torch.load(path, weights_only=True)


def test_last_interval_checkpoints_are_the_newest_by_updates(fp16_run):
    from fairseq_fp16_tools.checkpoints import last_interval_checkpoints

    names = [p.name for p in last_interval_checkpoints(fp16_run, 3)]
    updates = [int(n[:-3].split("_")[2]) for n in names]
    assert updates == [200, 300, 400], names
    assert [p.name for p in last_interval_checkpoints(fp16_run, 1)] == names[-1:]
    with pytest.raises(ValueError, match=r"holds 3 interval checkpoint\(s\) \(checkpoint_<epoch>_<updates>\.pt\), "
                                         r"fewer than the 4 to average: train with --save-interval-updates K "
                                         r"--keep-interval-updates 4"):
        last_interval_checkpoints(fp16_run, 4)
    with pytest.raises(ValueError, match=r"--last must be >= 1, got 0"):
        last_interval_checkpoints(fp16_run, 0)


def test_half_run_is_averaged_from_its_fp32_masters(fp16_run, tmp_path):
    from fairseq_fp16_tools.checkpoints import average, last_interval_checkpoints

    paths = last_interval_checkpoints(fp16_run, 3)
    summary = average(paths, tmp_path / "avg.pt")
    assert summary == {"precision": "fp16", "masters": True, "n": 3, "updates": [200, 300, 400],
                       "tensors": len(load(paths[-1])["model"])}
    srcs = [load(p) for p in paths]
    dst = load(tmp_path / "avg.pt")
    assert "last_optimizer_state" not in dst
    assert dst["extra_state"] == srcs[-1]["extra_state"]
    assert dst["optimizer_history"] == srcs[-1]["optimizer_history"]
    masters = [s["last_optimizer_state"]["master_params"] for s in srcs]
    mean_masters = [(sum(m[i].double() for m in masters) / 3).float() for i in sorted(masters[0], key=int)]
    table = dst["model"][SHARED_EMBEDDING[0]]
    assert all(torch.equal(dst["model"][k], table) for k in SHARED_EMBEDDING)
    from_masters, rounded_differs = 0, 0
    for k, v in dst["model"].items():
        assert v.dtype == srcs[-1]["model"][k].dtype, k
        if not v.is_floating_point():
            assert torch.equal(v, srcs[-1]["model"][k]), k
            continue
        match = [m for m in mean_masters if m.shape == v.shape and torch.equal(m, v)]
        mean_rounded = (sum(s["model"][k].double() for s in srcs) / 3).float()
        if match:  # a half-trained weight: the mean of its masters, not of its rounded copies
            from_masters += 1
            rounded_differs += int((mean_rounded != v).sum())
        else:  # an fp32 island (LayerNorm) or buffer: no master, the mean of the saved values
            assert "layer_norm" in k or not k.endswith((".weight", ".bias")), k
            assert torch.equal(v, mean_rounded), k
    assert from_masters == len(mean_masters) + 2  # the shared table has three names
    half_elements = sum(m.numel() for m in mean_masters)
    assert rounded_differs > 0.5 * half_elements, (rounded_differs, half_elements)


def test_one_checkpoint_averages_to_its_exported_masters(fp16_run, tmp_path):
    from fairseq_fp16_tools.checkpoints import average, export

    last = fp16_run / "checkpoint_last.pt"
    average([last], tmp_path / "avg.pt")
    export(last, tmp_path / "exported.pt")
    avg, exported = load(tmp_path / "avg.pt")["model"], load(tmp_path / "exported.pt")["model"]
    assert avg.keys() == exported.keys()
    assert all(torch.equal(avg[k], exported[k]) for k in avg)


def test_averaged_checkpoint_decodes_in_every_precision(toy_data, fp16_run, tmp_path):
    from fairseq_fp16_tools.checkpoints import average_main as main

    main([str(tmp_path / "avg.pt"), "--last", "3", "--dir", str(fp16_run)])
    _, ref, _ = generate(toy_data, fp16_run / "checkpoint_last.pt")
    for flags in ([], ["--fp16"], ["--bf16"]):
        proc, hyps, bleu = generate(toy_data, tmp_path / "avg.pt", *flags)
        assert proc.returncode == 0 and len(hyps) == 100, proc.stderr[-2000:]
        assert bleu is not None and bleu > 20, (flags, bleu)
    # a different model from the last checkpoint's, decoding the same toy task
    assert 50 <= sum(hyps[k] == ref[k] for k in ref) < 100


def test_fp32_run_averages_its_weights_and_refuses_mixing(toy_data, fp16_run, tmp_path):
    from fairseq_fp16_tools.checkpoints import average, last_interval_checkpoints
    from fairseq_fp16_tools.checkpoints import average_main as main

    train(toy_data, tmp_path / "fp32", "--max-update", "4", "--save-interval-updates", "2",
          "--keep-interval-updates", "2")
    paths = last_interval_checkpoints(tmp_path / "fp32", 2)
    summary = average(paths, tmp_path / "avg.pt")
    assert summary["precision"] == "fp32" and summary["masters"] is False and summary["updates"] == [2, 4]
    a, b, dst = load(paths[0])["model"], load(paths[1])["model"], load(tmp_path / "avg.pt")["model"]
    for k, v in dst.items():
        if v.is_floating_point():
            assert torch.equal(v, ((a[k].double() + b[k].double()) / 2).float()), k
    assert sum(not torch.equal(a[k], b[k]) for k in a) > 10  # the two steps moved the weights
    main([str(tmp_path / "cli.pt"), "--last", "2", "--dir", str(tmp_path / "fp32"),
          "--summary", str(tmp_path / "cli.json")])
    assert json.loads((tmp_path / "cli.json").read_text()) == {
        **summary, "checkpoints": [str(p) for p in paths], "dst": str(tmp_path / "cli.pt")}
    assert all(torch.equal(v, dst[k]) for k, v in load(tmp_path / "cli.pt")["model"].items())
    half = last_interval_checkpoints(fp16_run, 1)[0]
    with pytest.raises(ValueError, match=rf"{half.name} is an fp16 \(fp32 masters\) checkpoint, "
                                         r"\S+checkpoint_1_4\.pt an fp32 one: average the checkpoints of one run"):
        average([paths[1], half], tmp_path / "x.pt")
    with pytest.raises(SystemExit, match=r"average_checkpoints: no such checkpoint: \S+checkpoint_1_6\.pt"):
        main([str(tmp_path / "x.pt"), str(paths[1]), str(tmp_path / "fp32" / "checkpoint_1_6.pt")])
    with pytest.raises(SystemExit, match=r"average_checkpoints: \S+ holds 2 interval checkpoint\(s\)"):
        main([str(tmp_path / "x.pt"), "--last", "3", "--dir", str(tmp_path / "fp32")])
    assert not (tmp_path / "x.pt").exists()
