"""Which code and which software a benchmark's numbers come from.

    python -m fairseq_fp16_tools.provenance                 # print this checkout's record
    python -m fairseq_fp16_tools.provenance --stage PATH    # write PATH for a machine without git

:func:`describe` is the ``provenance`` record every benchmark JSON carries: the commit, which of
the project's source folders differ from it, a content hash of each, and the versions of torch,
CUDA, fairseq and Python. Where git works the commit is ``git rev-parse HEAD`` and the changed
folders are those ``git status`` names. A GPU machine gets the working tree without ``.git``;
there the commit comes from the file :func:`stage` wrote before the tree travelled
(``.whl/source.json``, written by ``scripts/gpu/prepare.sh``), and holds only for the folders
whose content hash still equals the staged one. Without either, the commit is unknown (None).
"""

import argparse
import hashlib
import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Dict, List, Optional

from .paths import ROOT

#: the project's source, as hashed: folders and files under the repository root
SOURCES = ("fairseq_fp16", "fairseq_fp16_tools", "scripts", "setup.py")
#: the plugin itself: a benchmark row is stale when this changed since its commit
PLUGIN = "fairseq_fp16"
#: where :func:`stage` writes by default, relative to the root (carried with the wheels)
STAGED = ".whl/source.json"
#: what running the code leaves beside it, never part of the hash
_SKIP_DIRS = {"__pycache__", ".pytest_cache"}
_SKIP_SUFFIXES = (".pyc", ".pyo")


def _git(root: Path, *args: str) -> Optional[str]:
    """``git -C root ARGS``'s output, or None where git or the repository is missing."""
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _skipped(rel: str) -> bool:
    parts = rel.split("/")
    return (any(p in _SKIP_DIRS or p.endswith(".egg-info") for p in parts[:-1])
            or rel.endswith(_SKIP_SUFFIXES))


def source_files(root: Path, git: bool = True) -> List[str]:
    """The source files under :data:`SOURCES`, as sorted paths relative to ``root``: git's
    tracked and unignored files where git works (what a device call copies), else every file
    but Python's caches."""
    listed = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *SOURCES) \
        if git else None
    if listed is not None:
        rels = [r for r in listed.split("\0") if r and (root / r).is_file()]
    else:
        rels = []
        for src in SOURCES:
            path = root / src
            found = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
            rels += [p.relative_to(root).as_posix() for p in found]
    return sorted(r for r in set(rels) if not _skipped(r))


def source_hashes(root: Path = ROOT, git: bool = True) -> Dict[str, str]:
    """``{source: hash}`` for each of :data:`SOURCES`: the first 16 hex digits of a SHA-256 over
    its files' relative paths and contents (a missing source hashes as empty)."""
    digests = {src: hashlib.sha256() for src in SOURCES}
    for rel in source_files(root, git):
        top = rel.split("/")[0]
        if top in digests:
            content = hashlib.sha256((root / rel).read_bytes()).hexdigest()
            digests[top].update(f"{rel}\0{content}\n".encode())
    return {src: d.hexdigest()[:16] for src, d in digests.items()}


def git_state(root: Path = ROOT) -> Optional[Dict]:
    """``{"commit", "changed"}`` from git (``changed``: the sources ``git status`` lists as
    modified or untracked), or None without git."""
    head = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "-z", "--untracked-files=all", "--", *SOURCES)
    if head is None or status is None:
        return None
    entries, paths = iter(status.split("\0")), []
    for entry in entries:
        if len(entry) > 3:
            paths.append(entry[3:])
            if entry[0] in "RC":  # a rename or copy: its source path follows, unprefixed
                paths.append(next(entries, ""))
    changed = {p.split("/")[0] for p in paths if p and not _skipped(p)}
    return {"commit": head.strip(), "changed": [s for s in SOURCES if s in changed]}


def stage(root: Path = ROOT, path: Optional[Path] = None) -> Dict:
    """Write the commit, the changed sources and the content hashes of ``root`` (a git checkout)
    to ``path`` (default ``root/.whl/source.json``); returns the record.

    Raises:
        RuntimeError: ``root`` is not a git checkout.
    """
    state = git_state(root)
    if state is None:
        raise RuntimeError(f"--stage needs a git checkout; {root} is none (or git is missing)")
    record = {**state, "source_hashes": source_hashes(root)}
    path = Path(path) if path is not None else root / STAGED
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def _from_staged(root: Path, hashes: Dict[str, str]) -> Optional[Dict]:
    """The staged commit, with every source whose hash moved since staging counted as changed."""
    try:
        staged = json.loads((root / STAGED).read_text())
        commit, was_changed, was = staged["commit"], set(staged["changed"]), staged["source_hashes"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    changed = was_changed | {s for s in SOURCES if was.get(s) != hashes[s]}
    return {"commit": commit, "changed": [s for s in SOURCES if s in changed]}


def _version(*dists: str) -> Optional[str]:
    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            pass
    return None


def describe(root: Path = ROOT) -> Dict:
    """The ``provenance`` record of a benchmark run from ``root``.

    ``commit``: the commit the source is at or based on, None when unknown; ``changed``: the
    sources (of :data:`SOURCES`) that differ from it, None when the commit is unknown;
    ``commit_from``: ``"git"``, ``"staged"`` (:func:`stage`'s file) or None;
    ``source_hashes``: :func:`source_hashes`; ``torch``, ``cuda`` (torch's CUDA build, None on
    a CPU build), ``fairseq``, ``python``: versions.
    """
    state = git_state(root)
    hashes = source_hashes(root, git=state is not None)
    how = "git" if state is not None else None
    if state is None:
        state = _from_staged(root, hashes)
        how = "staged" if state is not None else None
    try:
        import torch

        torch_version, cuda = torch.__version__, torch.version.cuda
    except ImportError:
        torch_version = cuda = None
    return {
        "commit": state["commit"] if state else None,
        "changed": state["changed"] if state else None,
        "commit_from": how,
        "source_hashes": hashes,
        "torch": torch_version,
        "cuda": cuda,
        "fairseq": _version("fairseq-fixed", "fairseq"),
        "python": platform.python_version(),
    }


def unique_records(records) -> List[Dict]:
    """The distinct provenance records among ``records`` (None left out), by commit and changed
    folders, in their first order."""
    seen, out = set(), []
    for r in records:
        if not isinstance(r, dict):
            continue
        key = (r.get("commit"), tuple(r.get("changed") or ()), tuple(sorted((r.get("source_hashes") or {}).items())))
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def label(record: Optional[Dict]) -> str:
    """``1a2b3c4d``, ``1a2b3c4d plus changes to scripts/`` or ``commit unknown``."""
    if not record or not record.get("commit"):
        return "commit unknown"
    short = record["commit"][:8]
    changed = record.get("changed")
    if changed is None:
        return f"{short} plus unknown changes"
    if changed:
        return f"{short} plus changes to " + ", ".join(s if "." in s else f"{s}/" for s in changed)
    return short


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", nargs="?", const=str(ROOT / STAGED), metavar="PATH",
                    help=f"write the commit and hashes for a machine without git (default {STAGED})")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout (default: this one)")
    a = ap.parse_args(argv)
    if a.stage:
        try:
            record = stage(a.root, Path(a.stage))
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        print(f"{a.stage}: {label(record)}")
        return 0
    record = describe(a.root)
    print(f"source: {label(record)} ({record['commit_from'] or 'no git, nothing staged'})")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
