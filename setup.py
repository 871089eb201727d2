"""embrace_fairseq: vocab-sharded embeddings with AlltoAll for fairseq and DeepSpeed.

CPU machines: install with ``scripts/setup.sh`` (pins torch 2.13.0, the CPU wheel,
before anything can pull a multi-GB CUDA build). GPU machines: install your own
CUDA torch first, then ``pip install --no-build-isolation -e .``.
"""
import os

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))


def _requirements():
    # The exact pins live in requirements/cpu-constraints.txt; install_requires only
    # states compatibility so a GPU user's own torch build is kept.
    return [
        "torch>=2.1",
        "fairseq-fixed==0.12.3.1",
        "deepspeed==0.19.8",
        "sacrebleu>=2.4",
        "sentencepiece>=0.2",
        "numpy",
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
    extras_require={"test": ["pytest>=8"], "plots": ["matplotlib"]},
    entry_points={
        "console_scripts": [
            "embrace-ds-train = embrace_fairseq.deepspeed_adapter.train:main",
            "embrace-prepare-data = embrace_fairseq.data_prep.__main__:main",
        ]
    },
)
