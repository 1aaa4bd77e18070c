"""`pip install` of this project into an environment that already has torch and fairseq: a new
virtual environment sees this checkout's torch and fairseq-fixed as installed packages (a `.pth`
file, as a system-wide or base installation is seen), and pip installs the project beside them
without touching either; one --fp16 update then trains with the installed plugin."""

import json
import shutil
import site
import subprocess
import sys
import venv

import pytest

from conftest import ROOT, TINY_MODEL, parse_json_records

pytestmark = pytest.mark.slow


def _python(env, *args, **kwargs):
    return subprocess.run([str(env / "bin" / "python"), *args], capture_output=True, text=True, **kwargs)


def _probe(env):
    code = ("import json, importlib.metadata as m, torch, fairseq\n"
            "print(json.dumps({'torch': torch.__version__, 'torch_file': torch.__file__, "
            "'fairseq': m.version('fairseq-fixed'), 'fairseq_file': fairseq.__file__}))")
    proc = _python(env, "-c", code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def user_env(tmp_path_factory):
    """A fresh environment whose torch and fairseq are this checkout's (not its own), and a copy
    of the project's source to install from (pip builds in the source folder)."""
    root = tmp_path_factory.mktemp("install")
    env = root / "env"
    venv.create(env, with_pip=True)
    own = _python(env, "-c", "import site; print(site.getsitepackages()[0])").stdout.strip()
    shared = site.getsitepackages()[0]
    (env / own.split(str(env) + "/", 1)[1] / "shared_torch_fairseq.pth").write_text(shared + "\n")
    # the shared setuptools (torch needs >= 77), not the older one venv bundles
    assert _python(env, "-m", "pip", "uninstall", "-y", "-q", "setuptools").returncode == 0
    source = root / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "data", ".whl", "build",
                                                                "*.egg-info", "__pycache__", "examples"))
    return env, source, shared


def test_pip_install_leaves_torch_and_fairseq_alone_and_an_fp16_update_trains(user_env, toy_data, tmp_path):
    env, source, shared = user_env
    before = _probe(env)
    assert before["torch_file"].startswith(shared)  # the environment's torch is the shared one
    install = _python(env, "-m", "pip", "install", "--no-build-isolation", "--no-index", str(source))
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    assert _probe(env) == before  # the same torch and fairseq, from the same place
    installed = _python(env, "-m", "pip", "list", "--path", str(env / "lib"), "--format", "json")
    own = {d["name"].lower() for d in json.loads(installed.stdout)}
    assert "torch" not in own and not any(n.startswith("fairseq-fixed") for n in own)

    # fairseq-fixed is an extra (.[fairseq]): a plain install must not put another fairseq over the
    # user's own build
    requires = _python(env, "-c", "import importlib.metadata as m; print(m.requires('fairseq_fp16'))",
                       cwd=tmp_path).stdout
    assert "'fairseq-fixed==0.12.3.1; extra == \"fairseq\"'" in requires and requires.count("fairseq") == 2
    # the plugin itself needs torch alone; the tools' libraries are the extra [tools]
    assert [r for r in eval(requires) if "extra ==" not in r] == ["torch>=2.4"]
    assert "'scipy; extra == \"tools\"'" in requires
    user_dir = _python(env, "-c", "from fairseq_fp16.cli import print_user_dir; print_user_dir()",
                       cwd=tmp_path).stdout.strip()
    assert user_dir.startswith(str(env)) and user_dir.endswith("fairseq_fp16")  # the installed copy
    train = _python(env, "-m", "fairseq_cli.train", str(toy_data), *TINY_MODEL, "--user-dir", user_dir,
                    "--task", "translation_fp16", "--optimizer", "fp16_adam", "--lr", "1e-3", "--max-tokens", "1000",
                    "--cpu", "--fp16", "--max-update", "1", "--no-save", "--disable-validation",
                    "--num-workers", "0", "--log-format", "json", "--log-interval", "1", cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    (record,) = parse_json_records(train.stdout + train.stderr)["train_inner"]
    assert (record["num_updates"], record["loss_scale"], record["skipped"]) == (1, 128, 0)
