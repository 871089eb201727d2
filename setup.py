"""embrace_fairseq: vocab-sharded embeddings with AlltoAll for fairseq and DeepSpeed.

CPU machines: install with ``scripts/setup.sh`` (torch 2.13.0+cpu from PyTorch's CPU
wheel index, before anything can pull a multi-GB CUDA build). GPU machines: install your
own CUDA torch first, then ``scripts/setup_gpu.sh``. docs/INSTALL.md has both.

The native ops in ``csrc/`` are an optional extension (``embrace_fairseq._native``):
built when torch and a C++ compiler are at hand (with the CUDA kernels when nvcc and
a CUDA torch are), skipped with a warning otherwise; the package works without it.
``EMBRACE_BUILD_NATIVE=0`` skips it on purpose.
"""
import glob
import hashlib
import os
import sys

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))


def _warn(msg):
    print(f"WARNING: embrace_fairseq._native: {msg}; installing without native ops", file=sys.stderr)


def native_source_hash(root=here):
    """Digest of csrc/ compiled into the extension; native_ops.py compares it at import."""
    h = hashlib.sha1()
    for path in sorted(glob.glob(os.path.join(root, "csrc", "*"))):
        if path.endswith((".cpp", ".cu", ".h")):
            h.update(os.path.basename(path).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return "h" + h.hexdigest()[:16]


def _native_extension():
    """(ext_modules, cmdclass) for the optional native ops; empty when they cannot be built."""
    if os.environ.get("EMBRACE_BUILD_NATIVE", "1") == "0":
        return [], {}
    if not os.path.exists(os.path.join(here, "csrc", "embrace_native.cpp")):
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except Exception as exc:  # e.g. an isolated build without torch
        _warn(f"torch is not importable at build time ({exc})")
        return [], {}

    cxx = ["-O3", "-g0", "-ffp-contract=off", f"-DEMBRACE_NATIVE_SOURCE_HASH={native_source_hash()}"]
    # Keep what static archives bring into the extension private to it. A toolchain that
    # links libstdc++ statically (some CUDA images' compilers do) otherwise exports its
    # copy: with Python's -Bsymbolic-functions the copy's functions bind to themselves but
    # its data (locale, facet ids) to torch's shared libstdc++, and the first formatted
    # error message (c10::str's ostringstream) crashed the process. A shared libstdc++
    # is not affected: the flag reaches static archives only.
    link = ["-Wl,--exclude-libs,ALL"] if sys.platform.startswith("linux") else []
    sources = ["csrc/embrace_native.cpp"]
    with_cuda = (
        torch.version.cuda is not None
        and cpp_extension.CUDA_HOME is not None
        and os.environ.get("EMBRACE_BUILD_CUDA", "1") != "0"
    )
    if with_cuda:
        ext = cpp_extension.CUDAExtension(
            "embrace_fairseq._native",
            sources + ["csrc/embrace_native_cuda.cu"],
            define_macros=[("EMBRACE_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]},
            extra_link_args=link,
        )
    else:
        ext = cpp_extension.CppExtension("embrace_fairseq._native", sources, extra_compile_args={"cxx": cxx},
                                         extra_link_args=link)

    class OptionalBuildExtension(cpp_extension.BuildExtension):
        """A failed native build (no compiler, bad toolchain) must not fail the install."""

        def run(self):
            try:
                super().run()
            except Exception as exc:
                _warn(f"build failed ({type(exc).__name__}: {exc})")

        def get_outputs(self):
            # editable installs copy these; list only what was really built
            return [p for p in super().get_outputs() if os.path.exists(p)]

    from setuptools.command.develop import develop

    class DevelopWithNative(develop):
        """setuptools >= 80 turns ``develop`` (what pip runs for ``-e`` here) into a nested,
        build-isolated ``pip install -e``, where torch is missing: build the extension in
        place first, with this environment's torch."""

        def run(self):
            self.reinitialize_command("build_ext", inplace=1)
            self.run_command("build_ext")
            super().run()

    return [ext], {"build_ext": OptionalBuildExtension, "develop": DevelopWithNative}


_ext_modules, _cmdclass = _native_extension()


def _requirements():
    # Ranges only: the exact versions tested live in requirements/*-constraints.txt, and a
    # range keeps a cluster's own torch and DeepSpeed instead of replacing them.
    return [
        "torch>=2.1",
        "fairseq-fixed>=0.12.3,<0.13",  # the fairseq 0.12 API (fairseq-fixed: fairseq 0.12.2 + install fixes)
        "deepspeed>=0.19",
        "sacrebleu>=2.4",
        "sentencepiece>=0.2",
        "numpy",
        "psutil",  # the benchmark launcher's memory guard
    ]


setup(
    name="embrace-fairseq",
    version="0.1.0",
    description="EmbRace: vocab-sharded embeddings with AlltoAll and 2D communication scheduling for fairseq and DeepSpeed",
    long_description=open(os.path.join(here, "README.md")).read() if os.path.exists(os.path.join(here, "README.md")) else "",
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    packages=find_packages(include=["embrace_fairseq", "embrace_fairseq.*"]),
    install_requires=_requirements(),
    ext_modules=_ext_modules,
    cmdclass=_cmdclass,
    extras_require={"test": ["pytest>=8"], "plots": ["matplotlib"]},
    entry_points={
        "console_scripts": [
            "embrace-ds-train = embrace_fairseq.deepspeed_adapter.train:main",
            "embrace-hydra-train = embrace_fairseq.fairseq_adapter.hydra_train:main",
            "embrace-prepare-data = embrace_fairseq.data_prep.__main__:main",
            "embrace-export-stock = embrace_fairseq.tools.export_stock:main",
        ]
    },
)
