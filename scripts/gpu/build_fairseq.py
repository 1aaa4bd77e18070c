#!/usr/bin/env python
"""Build fairseq-fixed from its source distribution where pip cannot reach a registry.

    python scripts/gpu/build_fairseq.py SDIST.tar.gz DEST

Unpacks the sdist into DEST, compiles the three extensions that training, generation and BLEU
need (``fairseq.data.data_utils_fast``, ``fairseq.data.token_block_utils_fast``,
``fairseq.libbleu``) in place, in parallel, and writes ``DEST/bin/fairseq-{train,generate,
preprocess}``. fairseq's own ``setup.py build_ext`` also compiles four torch C++ extensions
(BASE layers, the Levenshtein transformer's edit distance, alignment) that no translation
transformer imports, each a minute of compiling against torch's headers; they are left out.
Then ``PYTHONPATH=DEST`` and ``PATH=DEST/bin:$PATH`` make fairseq importable and its
commands callable; a ``fairseq_fixed-VERSION.dist-info`` in DEST gives ``importlib.metadata``
the version and the console scripts. Needs numpy, Cython, setuptools and a C++ compiler.
"""

import argparse
import os
import sys
import tarfile
from pathlib import Path

CLIS = {"fairseq-train": "train", "fairseq-generate": "generate", "fairseq-preprocess": "preprocess"}
FLAGS = ["-std=c++11", "-O3"]


def unpack(sdist: Path, dest: Path) -> Path:
    """The sdist's top folder, unpacked as DEST (kept if DEST/fairseq exists)."""
    if (dest / "fairseq").is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        top = dest.parent / tar.getnames()[0].split("/")[0]
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest.parent, filter="data")
        else:
            tar.extractall(dest.parent)
    if top != dest:
        top.rename(dest)
    return dest


def build(src: Path) -> None:
    import numpy
    from Cython.Build import cythonize
    from setuptools import Extension, setup

    exts = [
        Extension("fairseq.libbleu", ["fairseq/clib/libbleu/libbleu.cpp",
                                      "fairseq/clib/libbleu/module.cpp"], extra_compile_args=FLAGS),
        *(Extension(f"fairseq.data.{name}", [f"fairseq/data/{name}.pyx"], language="c++",
                    include_dirs=[numpy.get_include()], extra_compile_args=FLAGS)
          for name in ("data_utils_fast", "token_block_utils_fast")),
    ]
    here = os.getcwd()
    os.chdir(src)
    try:
        setup(name="fairseq-extensions", ext_modules=cythonize(exts, quiet=True),
              script_args=["-q", "build_ext", "--inplace", "-j", str(min(3, os.cpu_count() or 1))])
    finally:
        os.chdir(here)


def write_metadata(src: Path) -> None:
    """A dist-info beside the package, so that ``importlib.metadata`` finds fairseq-fixed's
    version and console scripts on ``PYTHONPATH`` (the tests' CLI server loads them there)."""
    version = (src / "fairseq" / "version.txt").read_text().strip()
    info = src / f"fairseq_fixed-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fairseq-fixed\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        "[console_scripts]\n" + "".join(f"{t} = fairseq_cli.{m}:cli_main\n" for t, m in CLIS.items()))


def write_clis(src: Path) -> None:
    bin_dir = src / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool, module in CLIS.items():
        path = bin_dir / tool
        path.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(src)!r})\n"
                        f"from fairseq_cli.{module} import cli_main\nsys.exit(cli_main())\n")
        path.chmod(0o755)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("sdist", type=Path, help="fairseq-fixed's source distribution (.tar.gz)")
    ap.add_argument("dest", type=Path, help="where it is unpacked and built")
    a = ap.parse_args(argv)
    src = unpack(a.sdist.resolve(), a.dest.resolve())
    build(src)
    write_metadata(src)
    write_clis(src)
    print(f"fairseq built in {src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
