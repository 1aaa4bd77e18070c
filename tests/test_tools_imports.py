"""fairseq_fp16_tools: imports flow one way (scripts -> fairseq_fp16_tools -> fairseq_fp16 ->
fairseq_fp16.core), and the tools that read results load neither fairseq nor the plugin."""

import ast
import importlib
import pkgutil
import re
import subprocess
import sys

import pytest

from conftest import ROOT

PACKAGE = "fairseq_fp16_tools"
MODULES = sorted(m.name for m in pkgutil.walk_packages([str(ROOT / PACKAGE)], PACKAGE + "."))
#: the modules that need torch and the plugin as they import (checkpoints, the benchmarks of
#: the plugin's core); every other one imports without fairseq
NEED_THE_PLUGIN = {f"{PACKAGE}.checkpoints", f"{PACKAGE}.bench.half_matmul", f"{PACKAGE}.bench.optimizer",
                   f"{PACKAGE}.bench.dropout", f"{PACKAGE}.bench.fused_loss", f"{PACKAGE}.bench.cpu_passes",
                   f"{PACKAGE}.bench.op_census"}  # the census reads the plugin's own test of a dense tensor


def _path(module: str):
    path = ROOT / module.replace(".", "/")
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _imports(module: str):
    """The absolute names ``module`` imports, at its top or inside its functions."""
    tree = ast.parse(_path(module).read_text())
    package = module if _path(module).name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES)
    return names


def test_every_tools_module_imports():
    for module in MODULES:
        importlib.import_module(module)


def test_tools_that_read_results_import_without_fairseq_or_the_plugin():
    light = [m for m in MODULES if m not in NEED_THE_PLUGIN]
    assert {f"{PACKAGE}.stats", f"{PACKAGE}.tables", f"{PACKAGE}.verdict", f"{PACKAGE}.render_docs",
            f"{PACKAGE}.bench.profile_summary", f"{PACKAGE}.bench.run_stats"} <= set(light)
    code = ("import importlib, sys\n"
            "for name in ('fairseq', 'fairseq_cli', 'fairseq_fp16'):\n"
            "    sys.modules[name] = None  # any import of them now fails\n"
            f"for module in {light!r}:\n"
            "    importlib.import_module(module)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_imports_flow_one_way():
    graph = {m: {n for n in _imports(m) if n in MODULES and n != m} for m in MODULES}
    done, stack = set(), []

    def visit(m):
        if m in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
        if m in done:
            return
        stack.append(m)
        for n in sorted(graph[m]):
            visit(n)
        stack.pop()
        done.add(m)

    for m in MODULES:
        visit(m)
    plugin = ROOT / "fairseq_fp16"
    back = [str(p.relative_to(ROOT)) for p in plugin.rglob("*.py") if PACKAGE in p.read_text()]
    assert back == [], "the plugin imports nothing of the tools"


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "scripts").glob("*.py")))
def test_scripts_are_command_lines_over_the_package(script):
    tree = ast.parse((ROOT / "scripts" / script).read_text())
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [ast.unparse(n).split(" import ")[0] for n in imports][:1] == ["import sys"]
    (tools,) = imports[1:]
    assert tools.module.startswith(PACKAGE + ".") and [a.asname or a.name for a in tools.names] == ["main"]


def test_no_sys_path_edits_in_scripts_or_tests():
    edit = re.compile(r"sys\.path\.(insert|append)\(|sys\.path\[\d*\]\s*=")
    # the console scripts build_fairseq.py writes for an unpacked fairseq, and the CLI server's
    # first import path set as a console script's is: both emulate how the real tools start
    allowed = {"scripts/gpu/build_fairseq.py", "tests/cli_server.py"}
    found = [str(p.relative_to(ROOT)) for folder in ("scripts", "tests") for p in (ROOT / folder).rglob("*.py")
             if edit.search(p.read_text())]
    assert sorted(set(found) - allowed) == []
