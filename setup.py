from setuptools import find_packages, setup

setup(
    name="fairseq_fp16",
    version="0.1.0",
    description="Mixed-precision (fp16/bf16) training for fairseq translation models, "
    "as a --user-dir plugin: fp32 master weights, fused Adam, loss scaling, fp32 islands",
    packages=find_packages(include=["fairseq_fp16", "fairseq_fp16.*", "fairseq_fp16_tools", "fairseq_fp16_tools.*"]),
    python_requires=">=3.9",
    # the plugin needs torch alone (and the fairseq it plugs into, which it leaves to the user)
    install_requires=["torch>=2.4"],  # an installed torch >= 2.4 is left as it is
    extras_require={
        # fairseq 0.12.2 cannot be imported on Python 3.11; this fork can. An extra, so that a
        # plain install leaves a fairseq already installed (the user's own build) alone.
        "fairseq": ["fairseq-fixed==0.12.3.1"],
        # the tools (compare.py, report.py, verdict.py) and the recipes' data preparation:
        # BLEU, chrF and paired significance; Student's t for the seed-paired equivalence test;
        # sentencepiece; Moses-style sentence splitting for the Debian corpus
        "tools": ["sacrebleu>=2.4", "scipy", "sentencepiece", "sentence-splitter"],
        "test": ["pytest>=7", "pytest-xdist>=3"],
        "plots": ["matplotlib"],
    },
    entry_points={
        "console_scripts": ["fairseq-fp16-user-dir=fairseq_fp16.cli:print_user_dir"],
    },
)
