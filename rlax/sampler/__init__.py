"""Generation engines: static batches (bucketed prefill + chunked KV-cache decode with in-flight weight swaps) and
continuous batching over decode slots."""

from rlax.sampler.continuous import ContinuousSampler, FinishedGroup, Stream
from rlax.sampler.engine import FINISH_REASONS, SampleOutput, Sampler, concat_outputs
from rlax.sampler.loop import EOS, LENGTH, STOP, row_keys
from rlax.sampler.strategies import Greedy, SamplingMethod, Temperature, TopK, TopP
