"""powernorm-fairseq: Power Normalization and its neighbours as a fairseq plugin.

torch and fairseq are not declared here on purpose: an unpinned ``torch``
pulls a multi-GB CUDA build, and fairseq's Python 3.11 fork requires
torchaudio, which pulls yet another torch. ``scripts/setup.sh`` installs both,
pinned, before this package.
"""

from setuptools import find_packages, setup

setup(
    name="powernorm-fairseq",
    version="0.1.0",
    description="PowerNorm, BatchNorm, ScaleNorm and friends for fairseq transformers",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.9",
    packages=find_packages(include=["powernorm_fairseq", "powernorm_fairseq.*"]),
    package_data={"powernorm_fairseq.norms.kernels": ["csrc/*.cpp"]},
    install_requires=["sacrebleu>=2", "sacremoses", "subword-nmt"],
    entry_points={
        "console_scripts": [
            "powernorm-average=powernorm_fairseq.cli.average:main",
            "powernorm-score=powernorm_fairseq.cli.score:main",
            "powernorm-analyze=powernorm_fairseq.cli.analyze:main",
            "powernorm-flags=powernorm_fairseq.cli.flags:main",
        ]
    },
)
