"""rlax: large-scale, preemptible RL post-training of LLMs in JAX.

The distribution is named `rlax-llm` (the PyPI name `rlax` is DeepMind's unrelated
RL library); the import package is `rlax`.
"""

from setuptools import find_packages, setup

setup(
    name="rlax-llm",
    version="0.1.0",
    description="Single-controller JAX framework for preemptible RL post-training of LLMs",
    packages=find_packages(include=["rlax", "rlax.*", "launch", "configs"]),
    package_data={"rlax": ["data/assets/*"]},
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.10.2",
        "flax>=0.12.8",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12.8",
        "chex>=0.1.92",
        "absl-py",
        "ml-collections",
        "numpy",
        "safetensors",
        "tokenizers",
        "jaxtyping",
        "grain",
        "math-verify",
        "tensorboardX",
        "tqdm",
        "psutil",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "torch==2.13.0", "transformers"],
        "tpu": ["jax[tpu]"],
        "pathways": ["pathwaysutils"],
        "xmanager": ["xmanager"],
    },
)
