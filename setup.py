from setuptools import find_packages, setup

setup(
    name="fairseq_fp16",
    version="0.1.0",
    description="Mixed-precision (fp16/bf16) training for fairseq translation models, "
    "as a --user-dir plugin: fp32 master weights, fused Adam, loss scaling, fp32 islands",
    packages=find_packages(include=["fairseq_fp16", "fairseq_fp16.*", "fairseq_fp16_tools", "fairseq_fp16_tools.*"]),
    python_requires=">=3.9",
    install_requires=[
        # an installed torch >= 2.4 is left as it is
        "torch>=2.4",
        "sacrebleu>=2.4",
        # Student's t for the seed-paired equivalence test (fairseq_fp16_tools/stats.py)
        "scipy",
        "sentencepiece",
        # Moses-style sentence splitting for the Debian corpus (examples/translation)
        "sentence-splitter",
    ],
    extras_require={
        # fairseq 0.12.2 cannot be imported on Python 3.11; this fork can. An extra, so that a
        # plain install leaves a fairseq already installed (the user's own build) alone.
        "fairseq": ["fairseq-fixed==0.12.3.1"],
        "test": ["pytest>=7"],
        "plots": ["matplotlib"],
    },
    entry_points={
        "console_scripts": ["fairseq-fp16-user-dir=fairseq_fp16.cli:print_user_dir"],
    },
)
