#!/usr/bin/env python
"""Resume a checkpoint of stock fairseq's --fp16 with the plugin; record whether its state carried.

    python scripts/gpu/stock_resume.py OUT.json DATA_BIN [--cpu] [--timeout 150]

Stock fairseq-train (``--task translation --optimizer adam --fp16``, no ``--user-dir``) trains a
tiny transformer for 4 updates and saves; the plugin (``--user-dir fairseq_fp16 --task
translation_fp16 --optimizer fp16_adam --fp16``) resumes that checkpoint to update 6. OUT.json:
``stock_precision``, ``stock_exit``, ``stock_updates`` (the stock run's last num_updates),
``resume_exit``, ``resumed_line`` (the plugin's "resumed from stock fairseq's ... state" line,
None when absent), ``resumed_at`` (the num_updates of the checkpoint fairseq loaded),
``last_updates`` and ``ok``: the line is there and the run went on from the stock run's update
count to the last update. Exits 1 when not ok.

With ``--cpu`` the stock run is fp32: stock fairseq's --fp16 (its FP16Optimizer) needs CUDA.
The plugin then resumes from FairseqAdam's state instead of FP16Optimizer's.
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

STOCK_UPDATES, LAST = 4, 6
USER_DIR = Path(__file__).resolve().parents[2] / "fairseq_fp16"
MODEL = ["--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1",
         "--encoder-embed-dim", "64", "--decoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128",
         "--decoder-ffn-embed-dim", "128", "--encoder-attention-heads", "2",
         "--decoder-attention-heads", "2", "--share-all-embeddings"]
COMMON = ["--lr", "1e-3", "--max-tokens", "2048", "--log-format", "simple", "--log-interval", "1",
          "--no-epoch-checkpoints", "--disable-validation", "--num-workers", "0", "--seed", "1"]


def train(args, timeout):
    """(exit code, log) of one fairseq-train run; exit code None when it passed ``timeout``."""
    try:
        proc = subprocess.run(["fairseq-train", *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        return None, out
    return proc.returncode, proc.stdout + proc.stderr


def last_updates(log: str):
    found = re.findall(r"num_updates=(\d+)", log)
    return int(found[-1]) if found else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("data")
    ap.add_argument("--cpu", action="store_true", help="no CUDA: the stock run is fp32")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds each run may take")
    a = ap.parse_args(argv)
    device = ["--cpu"] if a.cpu else []
    result = {"stock_precision": "fp32" if a.cpu else "fp16"}
    with tempfile.TemporaryDirectory() as save_dir:
        common = [a.data, *MODEL, *COMMON, "--save-dir", save_dir, *device]
        code, log = train([*common, "--task", "translation", "--optimizer", "adam",
                           "--max-update", str(STOCK_UPDATES), *([] if a.cpu else ["--fp16"])], a.timeout)
        # stock fairseq may abort at exit after saving (fairseq_fp16/patches/prefetch.py): -6 then
        done = code == 0 or (code == -6 and "done training" in log)
        result.update(stock_exit=code, stock_updates=last_updates(log))
        if not done or not (Path(save_dir) / "checkpoint_last.pt").exists():
            print(f"stock fairseq-train failed ({code}):\n{log[-3000:]}")
            result.update(ok=False, error="the stock run wrote no checkpoint")
        else:
            code, log = train([*common, "--user-dir", str(USER_DIR), "--task", "translation_fp16",
                               "--optimizer", "fp16_adam", "--fp16", "--max-update", str(LAST)], a.timeout)
            line = re.search(r"resumed from stock fairseq's .* carried over", log)
            loaded = re.search(r"loaded checkpoint \S+ \(epoch \d+ @ (\d+) updates\)", log, re.IGNORECASE)
            result.update(resume_exit=code, resumed_line=line.group(0) if line else None,
                          resumed_at=int(loaded.group(1)) if loaded else None, last_updates=last_updates(log))
            result["ok"] = (code == 0 and line is not None and result["resumed_at"] == result["stock_updates"]
                            and result["last_updates"] == LAST)
            if not result["ok"]:
                print(f"the plugin's resume ({code}):\n{log[-3000:]}")
    a.out.write_text(json.dumps(result) + "\n")
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
