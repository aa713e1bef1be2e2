"""Generation engines: static batches (bucketed prefill + chunked KV-cache decode with in-flight weight swaps) and
continuous batching over decode slots."""

from rlax.sampler.continuous import ContinuousSampler
from rlax.sampler.engine import FINISH_REASONS, SampleOutput, Sampler
from rlax.sampler.loop import EOS, LENGTH, STOP, row_keys
from rlax.sampler.strategies import Greedy, SamplingMethod, Temperature, TopK, TopP
