"""Generation engine: bucketed, jit-compiled prefill + chunked KV-cache decode with in-flight weight swaps."""

from rlax.sampler.engine import FINISH_REASONS, SampleOutput, Sampler
from rlax.sampler.loop import EOS, LENGTH, STOP, row_keys
from rlax.sampler.strategies import Greedy, SamplingMethod, Temperature, TopK, TopP
