"""Verifiers and rewards: math-verify, text matches, Countdown, sandboxed code, and a pool of grading
processes.

`reward_fn(completion, record) -> (reward, info)` everywhere; `registry.get(name)` selects one, and
`build(name, answer=..., format_weight=...)` adds a final-answer mode and a format bonus.
"""

from rlax.rewards.code import code_reward, extract_code, make_code_reward
from rlax.rewards.math import math_reward
from rlax.rewards.pool import GradeBatch, VerifierPool
from rlax.rewards.registry import auto_reward, build, combine, get, missing_reference, names, register
from rlax.rewards.code_tests import SandboxResult, run_tests
from rlax.rewards.sandbox import ProgramResult, SandboxLimits, isolation_mode, run_program
from rlax.rewards.text import (ANSWER_MODES, arithmetic_reward, check_answer_mode, countdown_reward,
                               exact_reward, extract_answer, extract_boxed, extract_final,
                               extract_last_number, extract_tag, format_reward, has_answer_format,
                               normalize_answer, overlong_penalty, parse_number)
