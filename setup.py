"""powernorm-fairseq: Power Normalization and its neighbours as a fairseq plugin.

torch and fairseq are not declared here on purpose: an unpinned ``torch``
pulls a multi-GB CUDA build, and fairseq's Python 3.11 fork requires
torchaudio, which pulls yet another torch. ``scripts/setup.sh`` installs both,
pinned, before this package.
"""

import hashlib
import platform
import sys

from setuptools import find_packages, setup

KERNELS = "powernorm_fairseq/norms/kernels/csrc/norms.cpp"


def cpu_kernels():
    """The C++ CPU kernels as an extension built at install (as fairseq builds
    its own), so that a run starts at once. It needs torch at build time: pip
    install --no-build-isolation (scripts/setup.sh does). Without torch the
    package builds the kernels on first use instead, as it does for a source
    checkout, and says so here."""
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("setup.py: torch is not importable here (pip's build isolation?): the CPU kernels will "
              "be built on first use; install with --no-build-isolation to build them now", file=sys.stderr)
        return {}, []
    source = hashlib.sha256(open(KERNELS, "rb").read()).hexdigest()[:12]
    flags = ["-O3", "-fopenmp", f"-DPOWERNORM_SOURCE=src{source}"]
    if platform.machine() in ("x86_64", "AMD64"):  # AVX2 and FMA; the loader checks the CPU has them
        flags.append("-march=x86-64-v3")
    extension = CppExtension("powernorm_fairseq.norms.kernels._C", [KERNELS], extra_compile_args=flags,
                             extra_link_args=["-fopenmp"])
    return {"build_ext": BuildExtension}, [extension]


commands, extensions = cpu_kernels()

setup(
    name="powernorm-fairseq",
    version="0.1.0",
    description="PowerNorm, BatchNorm, ScaleNorm and friends for fairseq transformers",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.11,<3.14",  # what scripts/setup.sh and fairseq-fixed support
    packages=find_packages(include=["powernorm_fairseq", "powernorm_fairseq.*"]),
    package_data={"powernorm_fairseq.norms.kernels": ["csrc/*.cpp"]},
    install_requires=["sacrebleu>=2", "sacremoses", "subword-nmt"],
    ext_modules=extensions,
    cmdclass=commands,
    entry_points={
        "console_scripts": [
            "powernorm-average=powernorm_fairseq.cli.average:main",
            "powernorm-score=powernorm_fairseq.cli.score:main",
            "powernorm-analyze=powernorm_fairseq.cli.analyze:main",
            "powernorm-flags=powernorm_fairseq.cli.flags:main",
        ]
    },
)
