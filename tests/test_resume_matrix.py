"""The resume matrix: every checkpoint a user can resume with the plugin, resumed.

A writer trains 3 updates of the tiny model and saves; the plugin resumes the checkpoint for 2
more. Writers: stock fairseq (its own fp32 run; its --fp16/--bf16 layouts, FP16Optimizer's,
built from that run as fairseq lays them out, since stock fairseq's half precision needs
CUDA), stock fairseq on a GPU with apex (``stock-apex``: fairseq's ``adam`` is apex's FusedAdam
there, which keeps the step count in the parameter group), and the plugin. Factors: the
precision written and the precision resumed (fp32, fp16, bf16), the optimizer (adam, the
plugin's fp16_adam, sgd, nag, adagrad, adafactor) and an fp32 EMA (--store-ema --ema-fp32) on
or off.

Each cell has one of two outcomes, pinned in ``docs/resume_matrix.json`` (the table of
docs/checkpoints.md is rendered from it):

* **kept**: right after the load, the resumed run holds what the writer saved: every fp32
  weight (the masters of a half run, the weights of an fp32 one; a half model holds them
  rounded), every parameter's optimizer state (moments, buffers, step counts), the loss scale
  and its counters, the skipped-update count and the EMA's fp32 weights, exactly; where the
  precision is unchanged (and the writer is a real run), the 5th update's state equals that of
  an uninterrupted 5-update run, exactly;
* **refused**: the resume stops with a message naming the flag to pass.

A raw error or a silent change fails the test. CI runs an all-pairs choice of the cells (every
pair of factor values in some cell); ``make soak`` runs the others. All of them,
``RESUME_MATRIX_WRITE=1 pytest -m "soak or not soak" tests/test_resume_matrix.py``, write the
outcomes to docs/resume_matrix.json (then ``python scripts/render_docs.py``).
"""

import copy
import itertools
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY_MODEL, USER_DIR
from inprocess import fairseq_train

#: fairseq and hydra warn on every in-process run (deprecated APIs, a CPU without pinned memory)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

MATRIX_JSON = ROOT / "docs" / "resume_matrix.json"
WRITE = os.environ.get("RESUME_MATRIX_WRITE") == "1"

WRITERS = ("stock", "stock-apex", "plugin")
PRECISIONS = ("fp32", "fp16", "bf16")
#: half runs cut batches as fairseq does on every CPU (padded lengths count toward --max-tokens
#: where --cpu-length-multiple pads, on AMX: test_stock_resume.py resumes across that)
PRECISION_FLAGS = {"fp32": [], "fp16": ["--fp16", "--cpu-length-multiple", "1"],
                   "bf16": ["--bf16", "--cpu-length-multiple", "1"]}
OPTIMIZERS = {
    "adam": ["--optimizer", "adam", "--adam-betas", "(0.9, 0.98)"],
    "fp16_adam": ["--optimizer", "fp16_adam", "--adam-betas", "(0.9, 0.98)"],
    "sgd": ["--optimizer", "sgd", "--momentum", "0.9"],
    "nag": ["--optimizer", "nag"],
    "adagrad": ["--optimizer", "adagrad"],
    "adafactor": ["--optimizer", "adafactor", "--beta1", "0.9"],
}
#: fairseq's optimizers that FP16Optimizer flattens into one fp32 parameter (supports_flat_params)
FLAT = ("adam", "sgd", "nag")
EMA = {"off": [], "on": ["--store-ema", "--ema-fp32", "--ema-decay", "0.9"]}
#: fp16_adam's no-decay parameter group (its --no-decay-params default)
NO_DECAY = ("bias", "layer_norm", "layernorm_embedding")
STOCK_LOSS_SCALE = 64.0  # a stock --fp16 layout's saved scale (not fairseq's initial 128)
WRITTEN, MORE = 3, 5

COMMON = [*TINY_MODEL, "--lr", "3e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "20",
          "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", "1000",
          "--cpu", "--seed", "1", "--no-epoch-checkpoints", "--num-workers", "0", "--disable-validation",
          "--log-format", "simple"]
PLUGIN = ["--user-dir", USER_DIR, "--task", "translation_fp16"]


def cells():
    """(writer, precision written, precision resumed, optimizer, EMA) of every cell."""
    for writer, written, resumed, opt, ema in itertools.product(WRITERS, PRECISIONS, PRECISIONS, OPTIMIZERS, EMA):
        if (writer == "stock" and opt == "fp16_adam") or (writer == "stock-apex" and opt != "adam"):
            continue
        yield writer, written, resumed, opt, ema


def cell_id(writer, written, resumed, opt, ema):
    return f"{writer}/{written}->{resumed}/{opt}/ema-{ema}"


def _pairs(cell):
    return {((i, a), (j, b)) for (i, a), (j, b) in itertools.combinations(enumerate(cell), 2)}


def all_pairs(cells, first=()):
    """Cells that together hold every pair of factor values that any cell holds (an all-pairs
    design): ``first``, then greedily the cell that adds the most pairs not yet held, first in
    order on a tie."""
    cells, chosen = list(cells), list(first)
    held = set().union(set(), *map(_pairs, chosen))
    needed = set().union(*map(_pairs, cells))
    while held != needed:
        best = max(cells, key=lambda c: len(_pairs(c) - held))
        chosen.append(best)
        held |= _pairs(best)
    return chosen


#: what CI runs (a half run continued in its own precision among them); `make soak` runs the others
PAIRS = set(all_pairs(cells(), first=[("plugin", "fp16", "fp16", "fp16_adam", "on"),
                                      ("plugin", "bf16", "bf16", "adam", "off")]))


#: (writer, optimizer written, optimizer resumed): fp16 resumed, from fp16 (plugin) or fp32 (stock)
CHANGES = [("plugin", "adam", "fp16_adam"), ("plugin", "fp16_adam", "adam"), ("plugin", "nag", "sgd"),
           ("stock", "adam", "fp16_adam"), ("stock", "nag", "adam"), ("stock-apex", "adam", "fp16_adam")]


def change_id(writer, saved, resumed):
    return f"{writer}/{saved}->{resumed}"


# ------------------------------------------------------------------ canonical states
def _canon_state(state, group_step):
    """One parameter's optimizer state: step counts as floats (int, tensor or the group's),
    tensors as fp32."""
    out = {}
    for k, v in (state or {}).items():
        if k == "step":
            out[k] = float(v)
        elif torch.is_tensor(v):
            out[k] = v.detach().float().cpu()
        else:
            out[k] = v
    if state and "step" not in out and group_step is not None:
        out["step"] = float(group_step)
    return out


def _inner_order(names, opt):
    """The trainer's parameter names in the order of the inner optimizer's state dict."""
    if opt != "fp16_adam":
        return list(names)
    no_decay = [n for n in names if any(s in n for s in NO_DECAY)]
    return [n for n in names if n not in no_decay] + no_decay


def saved_canon(path, names, opt):
    """What checkpoint ``path`` holds, by parameter name: fp32 weights, optimizer state, loss scale
    (a dict of the scaler's state; a stock layout's: only ``scale``), skipped updates, the EMA.
    Read as this test reads each layout, not through the plugin."""
    st = torch.load(path, weights_only=False, map_location="cpu")
    saved, model = st["last_optimizer_state"], st["model"]
    plugin = " (fairseq_fp16 " in st["optimizer_history"][-1]["optimizer_name"]  # e.g. "FP16Adam (fairseq_fp16 bf16)"
    if plugin:
        inner, order = saved["optimizer"], _inner_order(names, opt)
        masters = {saved["master_names"][i]: t for i, t in (saved.get("master_params") or {}).items()}
        scaler, skipped = saved.get("scaler"), saved.get("num_skipped", 0)
    else:
        inner, order, masters = saved, list(names), {}
        scaler = {"scale": saved["loss_scale"]} if "loss_scale" in saved else None
        skipped = 0
    ids = [i for g in inner["param_groups"] for i in g["params"]]
    group_step = {i: g.get("step") for g in inner["param_groups"] for i in g["params"]}
    states = [inner["state"].get(i) for i in ids]
    if len(ids) == 1 and len(order) > 1:  # FP16Optimizer's flat fp32 parameter, cut by name
        flat, per, offset = states[0], {}, 0
        for name in order:
            n = model[name].numel()
            per[name] = _canon_state({k: (v[offset:offset + n].view(model[name].shape) if torch.is_tensor(v) and v.dim()
                                          else v) for k, v in flat.items()}, group_step[ids[0]])
            offset += n
    else:
        assert len(ids) == len(order), (len(ids), len(order))
        per = {name: _canon_state(s, group_step[i]) for name, i, s in zip(order, ids, states)}
    extra = st["extra_state"]
    return {
        "num_updates": st["optimizer_history"][-1]["num_updates"],
        "weights": {n: masters[n] if n in masters else model[n].float() for n in names},
        "state": per, "scaler": scaler, "skipped": skipped,
        "ema_fp32": extra.get("ema_fp32_params"), "ema": extra.get("ema"),
    }


def live_canon(trainer):
    """The same of a trainer that has just loaded its checkpoint."""
    wrapper = trainer.optimizer
    inner = wrapper.inner.optimizer
    masters = wrapper.masters_by_param()
    group_of = {id(p): g for g in inner.param_groups for p in g["params"]}
    weights, half, per = {}, {}, {}
    for name, p in trainer.model.named_parameters():
        key = masters.get(id(p), p)
        weights[name] = key.detach().float().clone()
        if p.dtype != torch.float32:
            half[name] = p.detach().clone()
        per[name] = _canon_state(copy.deepcopy(inner.state.get(key)), group_of[id(key)].get("step"))
    ema = trainer.ema if trainer.cfg.ema.store_ema else None
    return {
        "num_updates": trainer.get_num_updates(), "weights": weights, "half": half, "state": per,
        "scaler": wrapper.loss_scaler.state_dict() if wrapper.loss_scaler is not None else None,
        "skipped": wrapper.overflow.skipped,
        "ema_fp32": {k: v.clone() for k, v in ema.fp32_params.items()} if ema is not None else None,
        "ema": {k: v.clone() for k, v in ema.get_model().state_dict().items()} if ema is not None else None,
    }


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and torch.equal(a.float(), b.float())
    return a == b


def differences(expected, got, resumed_half: bool, expected_scaler):
    """What ``got`` (live, or a final checkpoint) holds that ``expected`` does not: [] when kept."""
    out = []
    if got["num_updates"] != expected["num_updates"]:
        out.append(f"num_updates {got['num_updates']} != {expected['num_updates']}")
    for name, w in expected["weights"].items():
        if not _same(got["weights"][name], w):
            out.append(f"fp32 weight {name}")
        if name in got.get("half", {}) and not _same(got["half"][name], w.to(got["half"][name].dtype)):
            out.append(f"half weight {name} is not its fp32 weight rounded")
    for name, st in expected["state"].items():
        mine = got["state"][name]
        if sorted(mine) != sorted(st):
            out.append(f"optimizer state of {name}: keys {sorted(mine)} != {sorted(st)}")
            continue
        out += [f"optimizer state {name}[{k}]" for k in st if not _same(mine[k], st[k])]
    if resumed_half:
        scaler = got["scaler"]
        for k, v in expected_scaler.items():
            if scaler.get(k) != v:
                out.append(f"loss scaler {k}: {scaler.get(k)} != {v}")
    if got["skipped"] != expected["skipped"]:
        out.append(f"skipped updates {got['skipped']} != {expected['skipped']}")
    if expected["ema_fp32"] is not None:
        if sorted(got["ema_fp32"]) != sorted(expected["ema_fp32"]):
            out.append("EMA fp32 keys")
        else:
            out += [f"EMA fp32 {k}" for k, v in expected["ema_fp32"].items() if not _same(got["ema_fp32"][k], v)]
        if "half" in got:  # live: the EMA model is the fp32 EMA in the model's dtype
            out += [f"EMA model {k}" for k, v in expected["ema"].items()
                    if not _same(got["ema"][k], expected["ema_fp32"].get(k, v).to(got["ema"][k].dtype))]
        else:  # two checkpoints (fairseq saves the EMA model widened to fp32)
            out += [f"EMA model {k}" for k, v in expected["ema"].items() if not _same(got["ema"][k], v)]
    return out


def expected_scaler(saved, writer, written, resumed):
    """The loss scaler a half resume must hold. fp16 scales dynamically (fairseq's initial scale
    128), bf16 statically at 1, and a static scale is the flag's, not the checkpoint's. A dynamic
    resume of the plugin's dynamic (fp16) state holds all of it; of a stock --fp16 layout, its
    scale with fresh counters; of anything else, a fresh scaler. The plugin's update counters
    carry over in every case."""
    counters = {k: saved["scaler"][k] for k in ("num_updates", "num_overflows")} \
        if writer == "plugin" and written != "fp32" else {"num_updates": 0, "num_overflows": 0}
    if resumed == "bf16":
        return {"scale": 1.0, "dynamic": False, **counters}
    if writer == "plugin" and written == "fp16":
        return saved["scaler"]
    fresh = {"scale": 128.0, "dynamic": True, "clean_steps": 0, **counters}
    if writer != "plugin" and saved["scaler"] is not None:  # a stock --fp16 layout's scale
        return dict(fresh, scale=saved["scaler"]["scale"])
    return fresh


# ------------------------------------------------------------------------- writers
def stock_layout(base: Path, out: Path, precision: str, opt: str, apex: bool) -> Path:
    """The checkpoint stock fairseq would write with ``precision`` (and apex), from its fp32 run's:
    FP16Optimizer's state (one flat fp32 parameter for optimizers that support it, under --fp16;
    a parameter list under --bf16 or otherwise), the half model, the loss scale (fp16), the EMA
    model in the model's dtype; apex's FusedAdam: step counts in the group."""
    st = torch.load(base / "checkpoint_last.pt", weights_only=False)
    saved = st["last_optimizer_state"]
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    if apex:  # FusedAdamV2: per-parameter moments, one step count in the group
        steps = {int(saved["state"][i].pop("step")) for i in ids}
        assert len(steps) == 1
        saved["param_groups"][0]["step"] = steps.pop()
    if precision != "fp32":
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
        st["model"] = {k: v.to(dtype) if v.is_floating_point() else v for k, v in st["model"].items()}
        if "ema" in st["extra_state"]:
            st["extra_state"]["ema"] = {k: v.to(dtype) if v.is_floating_point() else v
                                        for k, v in st["extra_state"]["ema"].items()}
        if precision == "fp16" and opt in FLAT:
            first = saved["state"][ids[0]]
            flat = {k: torch.cat([saved["state"][i][k].flatten() for i in ids]) if torch.is_tensor(v) and v.dim()
                    else v for k, v in first.items()}
            saved["state"] = {0: flat}
            saved["param_groups"] = [dict(saved["param_groups"][0], params=[0])]
        if precision == "fp16":
            saved["loss_scale"] = STOCK_LOSS_SCALE
        st["optimizer_history"][-1]["optimizer_name"] = "FP16Optimizer"
        st["cfg"]["common"][precision] = True
    out.mkdir(parents=True)
    torch.save(st, out / "checkpoint_last.pt")
    return out


class Writers:
    """Each writer's checkpoint directory, made once (in-process runs)."""

    def __init__(self, data, root: Path):
        self.data, self.root, self.made = data, root, {}

    def _run(self, folder: Path, *args, stock=False, updates=WRITTEN):
        task = ["--task", "translation"] if stock else PLUGIN
        fairseq_train([self.data, *COMMON, *task, "--save-dir", folder, "--max-update", updates, *args], stock=stock)
        return folder

    def get(self, writer, precision, opt, ema, updates=WRITTEN) -> Path:
        key = (writer, precision, opt, ema, updates)
        if key not in self.made:
            folder = self.root / "-".join(map(str, key))
            flags = [*OPTIMIZERS[opt], *EMA[ema]]
            if writer == "plugin":
                self.made[key] = self._run(folder, *PRECISION_FLAGS[precision], *flags, updates=updates)
            elif precision == "fp32" and writer == "stock":
                self.made[key] = self._run(folder, *flags, stock=True)
            else:
                self.made[key] = stock_layout(self.get("stock", "fp32", opt, ema), folder, precision, opt,
                                              apex=writer == "stock-apex")
        return self.made[key]


@pytest.fixture(scope="module")
def writers(toy_data, tmp_path_factory):
    return Writers(toy_data, tmp_path_factory.mktemp("writers"))


def _resume(writers, source: Path, folder: Path, *flags):
    """Resume ``source``'s checkpoint in ``folder`` for updates 4-5: (outcome, live state at the
    load or the refusal's message)."""
    shutil.copytree(source, folder)
    seen = {}
    try:
        fairseq_train([writers.data, *COMMON, *PLUGIN, "--save-dir", folder, "--max-update", MORE, *flags],
                      on_load=lambda trainer, extra: seen.setdefault("live", live_canon(trainer)))
    except Exception as e:  # a refusal must name the flag to pass, anything else fails the cell
        message = str(e)
        if not re.search(r"--[a-z][a-z0-9-]+", message):
            raise
        return "refused", message
    return "kept", seen["live"]


def _pinned():
    return json.loads(MATRIX_JSON.read_text()) if MATRIX_JSON.exists() else {"cells": {}, "changes": {}}


FOUND = {"cells": {}, "changes": {}}


@pytest.fixture(scope="module", autouse=True)
def _write_outcomes():
    yield
    if WRITE:
        from fairseq_fp16_tools.provenance import describe

        found = {k: dict(sorted(v.items())) for k, v in FOUND.items()}
        MATRIX_JSON.write_text(json.dumps({**found, "provenance": describe()}, indent=1) + "\n")


def test_the_ci_cells_hold_every_pair_of_factor_values():
    assert set().union(*map(_pairs, PAIRS)) == set().union(*map(_pairs, cells()))
    assert len(PAIRS) < 30  # of 216


@pytest.mark.parametrize("writer,written,resumed,opt,ema", [
    c if c in PAIRS else pytest.param(*c, marks=pytest.mark.soak) for c in cells()], ids=[cell_id(*c) for c in cells()])
def test_a_resume_keeps_the_state_or_names_the_flag(writers, tmp_path, writer, written, resumed, opt, ema):
    flags = [*PRECISION_FLAGS[resumed], *OPTIMIZERS[opt], *EMA[ema]]
    source = writers.get(writer, written, opt, ema)
    outcome, live = _resume(writers, source, tmp_path / "resumed", *flags)
    cell = {"outcome": outcome, "message": live if outcome == "refused" else None, "continued": None}
    if outcome == "kept":
        names = list(live["weights"])
        saved = saved_canon(source / "checkpoint_last.pt", names, opt)
        assert differences(saved, live, resumed != "fp32", expected_scaler(saved, writer, written, resumed)) == []
        if written == resumed and (writer == "plugin" or written == "fp32") and writer != "stock-apex":
            full = writers.get("plugin", resumed, opt, ema, updates=MORE)
            final = saved_canon(tmp_path / "resumed" / "checkpoint_last.pt", names, opt)
            ref = saved_canon(full / "checkpoint_last.pt", names, opt)
            assert differences(ref, final, resumed != "fp32", ref["scaler"] or {}) == []
            cell["continued"] = "equal"
    key = cell_id(writer, written, resumed, opt, ema)
    FOUND["cells"][key] = cell
    if not WRITE:
        assert cell == _pinned()["cells"].get(key), "outcome changed: RESUME_MATRIX_WRITE=1 writes the new one"


@pytest.mark.parametrize("writer,saved_opt,resumed_opt", CHANGES, ids=[change_id(*c) for c in CHANGES])
def test_another_optimizer_on_resume_is_refused_or_carried_exactly(writers, tmp_path, writer, saved_opt, resumed_opt):
    written = "fp16" if writer == "plugin" else "fp32"
    source = writers.get(writer, written, saved_opt, "off")
    outcome, live = _resume(writers, source, tmp_path / "resumed", "--fp16", *OPTIMIZERS[resumed_opt])
    if outcome == "kept":
        saved = saved_canon(source / "checkpoint_last.pt", list(live["weights"]), saved_opt)
        assert differences(saved, live, True, expected_scaler(saved, writer, written, "fp16")) == []
    change = {"outcome": outcome, "message": live if outcome == "refused" else None}
    key = change_id(writer, saved_opt, resumed_opt)
    FOUND["changes"][key] = change
    if not WRITE:
        assert change == _pinned()["changes"].get(key), "outcome changed: RESUME_MATRIX_WRITE=1 writes the new one"


def test_reset_optimizer_resumes_another_optimizer_afresh(writers, tmp_path):
    source = writers.get("plugin", "fp16", "adam", "off")
    outcome, live = _resume(writers, source, tmp_path / "resumed", "--fp16", *OPTIMIZERS["fp16_adam"],
                            "--reset-optimizer")
    # fairseq's --reset-optimizer restarts the update count too: 5 updates of a fresh fp16_adam
    assert outcome == "kept" and live["num_updates"] == 0
    assert {s.get("step") for s in live["state"].values()} == {None}
    final = torch.load(tmp_path / "resumed" / "checkpoint_last.pt", weights_only=False)
    assert final["last_optimizer_state"]["optimizer_name"] == "fp16_adam"
    assert final["optimizer_history"][-1]["num_updates"] == MORE
    assert {float(s["step"]) for s in final["last_optimizer_state"]["optimizer"]["state"].values()} == {float(MORE)}
