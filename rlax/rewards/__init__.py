"""Verifiers and rewards: math-verify, text matches, Countdown, sandboxed code, and a thread pool.

`reward_fn(completion, record) -> (reward, info)` everywhere; `registry.get(name)` selects one.
"""

from rlax.rewards.code import code_reward, extract_code, make_code_reward
from rlax.rewards.math import math_reward
from rlax.rewards.pool import GradeBatch, VerifierPool
from rlax.rewards.registry import auto_reward, combine, get, names, register
from rlax.rewards.sandbox import SandboxLimits, SandboxResult, isolation_mode, run_tests
from rlax.rewards.text import (arithmetic_reward, countdown_reward, exact_reward, extract_answer,
                               extract_tag, format_reward, normalize_answer, overlong_penalty)
