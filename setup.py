"""The C++ CPU kernels of powernorm-fairseq, an extension built at install.
The package's metadata and dependencies are in pyproject.toml."""

import hashlib
import os
import platform
import sys

from setuptools import setup

CSRC = "powernorm_fairseq/norms/kernels/csrc"
KERNELS = f"{CSRC}/norms.cpp"  # the one translation unit; it includes the other files of CSRC


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
    digest = hashlib.sha256()  # of every file of the source, as compiled.source_digest reads it
    for name in sorted(os.listdir(CSRC)):
        digest.update(name.encode() + b"\0" + open(os.path.join(CSRC, name), "rb").read())
    source = digest.hexdigest()[:12]
    # -fno-trapping-math: DyT's tanh (a clamp and a select) vectorizes; no value changes, only FP exception flags
    flags = ["-O3", "-fno-trapping-math", "-fopenmp", f"-DPOWERNORM_SOURCE=src{source}"]
    if platform.machine() in ("x86_64", "AMD64"):  # AVX2 and FMA; the loader checks the CPU has them
        flags.append("-march=x86-64-v3")
    extension = CppExtension("powernorm_fairseq.norms.kernels._C", [KERNELS], extra_compile_args=flags,
                             extra_link_args=["-fopenmp"])

    class Build(BuildExtension):
        """Compiles into build/kernels of the source tree, also for an editable
        install (which would use a temporary directory): ninja then recompiles
        only when the source, a header or the command changed, and a second
        install of the same source, editable or not, only links."""

        def finalize_options(self):
            super().finalize_options()
            self.build_temp = os.path.join("build", "kernels")

    return {"build_ext": Build}, [extension]


def archive_guard(commands):
    """``powernorm_fairseq-archives.pth`` at the root of site-packages, beside the package: Python runs it
    at start-up in every process of the environment, and it loads ``patches/archives.py`` alone, which
    guards fairseq's archive extraction whatever the process imports first (that module's docstring).
    Written by build_py, which a wheel and an editable install both run: into the build's library (a
    wheel), or, editable, straight into the wheel setuptools makes (its install_lib), as it does with
    the files that are not part of the editable mapping."""
    import importlib.util

    from setuptools.command.build_py import build_py

    spec = importlib.util.spec_from_file_location("_archives", "powernorm_fairseq/patches/archives.py")
    archives = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(archives)

    class BuildPy(build_py):
        def run(self):
            super().run()
            where = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
            os.makedirs(where, exist_ok=True)
            with open(os.path.join(where, PTH), "w") as f:
                f.write(archives._pth())

    return {**commands, "build_py": BuildPy}


PTH = "powernorm_fairseq-archives.pth"
commands, extensions = cpu_kernels()

setup(ext_modules=extensions, cmdclass=archive_guard(commands))
