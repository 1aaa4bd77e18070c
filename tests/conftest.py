"""Shared fixtures: a tiny synthetic corpus and helpers that run the real CLIs."""

import atexit
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fairseq_fp16_tools.runs import parse_json_records  # noqa: F401  (fairseq's json log records)

ROOT = Path(__file__).resolve().parents[1]

BIN = Path(sys.executable).parent


def load_file(path: Path):
    """The module of a file that belongs to no package (a GPU staging script, an example),
    imported from its path."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def tool_path(tool: str) -> str:
    """The console script beside this interpreter, else the one on PATH (a GPU machine's
    staged fairseq: scripts/gpu/build_fairseq.py)."""
    path = BIN / tool
    return str(path) if path.exists() else (shutil.which(tool) or str(path))


def _cli_env():
    # faulthandler: a crash in C++ code prints every thread's Python stack to stderr
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
    env.pop("PYTEST_CURRENT_TEST", None)  # pytest's, changes with every test
    for name in ("KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"):  # scikit-learn's import sets them, in
        env.pop(name, None)  # this process and in every fairseq tool (fairseq imports it)
    return env


CLI_ENV = _cli_env()  # the tools' environment in a test that changed none
#: variables torch, oneDNN, OpenMP or fairseq may read as they load: a change needs a fresh process
#: (others, such as TORCHINDUCTOR_CACHE_DIR that a torch import sets here, are set in the fork)
IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "GOMP_", "ONEDNN_", "DNNL_", "LRU_CACHE_CAPACITY", "LOGLEVEL",
                   "CUDA_", "TORCH_", "PYTORCH_", "PYTHON", "LD_", "FAIRSEQ_FP16_TEST_FRESH_PROCESS")
USER_DIR = str(ROOT / "fairseq_fp16")

TINY_MODEL = [
    "--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1",
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--share-all-embeddings", "--dropout", "0.1",
]
TRAIN = [
    "--task", "translation_fp16", "--optimizer", "fp16_adam", "--adam-betas", "(0.9, 0.98)",
    "--lr", "3e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "20",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--max-tokens", "1000", "--cpu", "--seed", "1", "--log-format", "json",
    "--log-interval", "1", "--no-epoch-checkpoints", "--num-workers", "0",
]


@pytest.fixture(autouse=True)
def _kernel_cache_env_restored():
    """A translation_fp16 task built in the test process (export_fp32_checkpoint's tests, also in
    module-scoped fixtures) sets oneDNN's cache capacities in os.environ on a CPU with half units;
    put them back as the session began, or every later fairseq run would differ from CLI_ENV and
    start as a fresh process."""
    from fairseq_fp16.core.cpu_kernel_cache import CACHE_ENV_VARS

    yield
    for var in CACHE_ENV_VARS:
        if CLI_ENV.get(var) is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = CLI_ENV[var]


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory):
    from fairseq_fp16_tools.corpus import write_corpus

    return write_corpus(tmp_path_factory.mktemp("toy"), train=2000, valid=100, test=100)


class _CliServer:
    """Client of `cli_server.py`: one of fairseq's tools runs in forks of a process that imported it.

    One server a tool: each tool's module sets up logging as it imports, as in a fresh process.
    Set FAIRSEQ_FP16_TEST_FRESH_PROCESS=1 to start every run as its own process instead.
    """

    def __init__(self, tool):
        self.log = tempfile.TemporaryFile("w+")  # the server's own stderr: what its imports log
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "cli_server.py"), tool],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=CLI_ENV)
        atexit.register(self.close)

    def run(self, tool, args, tmp, env_changes):
        out, err = tmp / "stdout", tmp / "stderr"
        req = dict(tool=tool, args=args, cwd=os.getcwd(), stdout=str(out), stderr=str(err), env=env_changes)
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            self.log.seek(0)
            raise RuntimeError(f"tests/cli_server.py ended (status {self.proc.wait()}) running {tool} {args}; "
                               f"its stderr:\n{self.log.read()[-4000:]}")
        rc = json.loads(answer)["rc"]
        return subprocess.CompletedProcess([tool, *args], rc, out.read_text(), err.read_text())

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


_servers = {}
#: how the tools ran: "forked" or "fresh (KEYS)" -> count, reported at the end of the session
RUNS = {}


def run_cli(tool, args, check=True):
    """Run one of fairseq's tools, like `subprocess.run` with its output captured.

    A test that changed a variable of IMPORT_TIME_ENV gets a process of its own (what torch and
    fairseq read as they load is fixed in the server); the others run in a fork of
    `cli_server.py`, with the environment's other changes set in the fork.
    """
    env = _cli_env()
    args = [str(a) for a in args]
    changed = sorted(k for k in set(env) | set(CLI_ENV) if env.get(k) != CLI_ENV.get(k))
    fresh = [k for k in changed if k.startswith(IMPORT_TIME_ENV)]
    if fresh:
        how = f"fresh ({', '.join(fresh)})"
        RUNS[how] = RUNS.get(how, 0) + 1
        proc = subprocess.run([tool_path(tool), *args], capture_output=True, text=True, env=env)
    else:
        RUNS["forked"] = RUNS.get("forked", 0) + 1
        server = _servers.get(tool) or _servers.setdefault(tool, _CliServer(tool))
        with tempfile.TemporaryDirectory() as tmp:
            proc = server.run(tool, args, Path(tmp), {k: env.get(k) for k in changed})
    if check and proc.returncode != 0:
        raise AssertionError(f"{tool} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                             f"{proc.stderr[-4000:]}")
    return proc


def train(data, save_dir, *extra, user_dir=True, model=TINY_MODEL, check=True, cuda=False):
    """Run fairseq-train (on the GPU with ``cuda``); returns (process, per-update train_inner records)."""
    common = [a for a in TRAIN if a != "--cpu"] if cuda else TRAIN
    if not user_dir:  # stock fairseq: its own task and optimizer
        common = [{"translation_fp16": "translation", "fp16_adam": "adam"}.get(a, a) for a in common]
    args = [data, *model, *common, "--save-dir", save_dir, *extra]
    if user_dir:
        args += ["--user-dir", USER_DIR]
    proc = run_cli("fairseq-train", args, check=check and user_dir)
    if check and not user_dir and proc.returncode != 0 and not stock_abort_at_exit(proc):
        raise AssertionError(f"fairseq-train (stock) failed ({proc.returncode}):\n"
                             f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc, parse_json_records(proc.stdout + proc.stderr)["train_inner"]


def plugin_optimizer(cfg, params, name: str):
    """The plugin's optimizer wrapper (what the patched trainer builds) in precision ``name``,
    with the loss scaling of ``cfg``'s ``--loss-scale``."""
    from fairseq_fp16.optim.mixed_precision import MixedPrecisionFairseqOptimizer
    from fairseq_fp16.precision import Precision

    loss_scale = getattr(getattr(cfg, "task", None), "loss_scale", None)
    return MixedPrecisionFairseqOptimizer(cfg, params, Precision.from_flags(name == "fp16", name == "bf16", loss_scale))


def allocation_bytes(fn, tmp_path) -> list:
    """The CPU tensor allocations (positive) and frees (negative) that ``fn`` makes, in bytes and
    in time order, from torch.profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    trace = tmp_path / "memory.json"
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    return [e["args"]["Bytes"] for e in sorted(events, key=lambda e: e["ts"])]


def stock_abort_at_exit(proc) -> bool:
    """Stock fairseq's abort after its work is done (a prefetch thread ended inside torch at exit;
    fairseq_fp16/patches/prefetch.py, tests/test_clean_exit.py): the run finished and saved, then the
    process got SIGABRT. It strikes now and then; a test that only needs a stock checkpoint
    accepts it (the plugin's runs never do)."""
    return (proc.returncode == -6 and "done training" in proc.stdout + proc.stderr
            and "terminate called without an active exception" in proc.stderr)


def pytest_sessionfinish(session):
    """An xdist worker hands its counts of :data:`RUNS` to the controller, which reports them."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["fairseq_cli_runs"] = dict(RUNS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    for key, count in getattr(node, "workeroutput", {}).get("fairseq_cli_runs", {}).items():
        RUNS[key] = RUNS.get(key, 0) + count


def pytest_terminal_summary(terminalreporter):
    if RUNS:  # a silent fall-back to fresh processes would only show as a slower suite
        terminalreporter.write_line("fairseq CLI runs: " + "; ".join(f"{k}: {v}" for k, v in sorted(RUNS.items())))
