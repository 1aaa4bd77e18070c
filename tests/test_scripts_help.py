"""Every script under scripts/ answers --help: its usage on stdout, exit status 0, nothing run."""

import json
import subprocess
import sys

from conftest import ROOT

PYTHON = sorted(p.relative_to(ROOT) for p in (ROOT / "scripts").rglob("*.py"))
SHELL = sorted(p.relative_to(ROOT) for p in (ROOT / "scripts").rglob("*.sh"))

#: each Python script run as __main__ with --help, in one process (fairseq imported once)
HELP_ALL = """
import contextlib, io, json, runpy, sys
answers = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else repr(e.code))
    except Exception as e:
        code = repr(e)
    answers[path] = [code, out.getvalue()]
print(json.dumps(answers))
"""


def test_every_python_script_answers_help():
    assert len(PYTHON) >= 20
    proc = subprocess.run([sys.executable, "-c", HELP_ALL, *map(str, PYTHON)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    answers = json.loads(proc.stdout.strip().splitlines()[-1])
    wrong = {p: a[0] for p, a in answers.items() if a[0] != 0 or "usage" not in a[1].lower()}
    assert not wrong, wrong


def test_every_shell_script_answers_help():
    """Its opening comment, without the comment marks, and nothing run (no command of it)."""
    assert len(SHELL) == 3
    for path in SHELL:
        proc = subprocess.run(["bash", "-x", str(ROOT / path), "--help"], capture_output=True, text=True,
                              timeout=30)
        comment = (ROOT / path).read_text().splitlines()[1:4]
        assert proc.returncode == 0, (path, proc.stderr[-500:])
        assert proc.stdout.splitlines()[:3] == [line[2:] for line in comment]
        assert f"bash {path}" in proc.stdout
        traced = [c for c in proc.stderr.splitlines() if c.startswith("+ ")]
        assert len(traced) == 4 and traced[2].startswith("+ sed -n") and traced[3] == "+ exit 0", traced
