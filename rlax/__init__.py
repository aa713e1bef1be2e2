"""rlax: large-scale, preemptible RL post-training of LLMs in JAX (after arXiv 2512.06392)."""

__version__ = "0.1.0"
