"""The sampling engine: continuous batching over decode slots, two cache layouts of one decode step, streams
whose held rows can be extended, sampling strategies."""

from rlax.sampler.engine import Sampler
from rlax.sampler.layouts import ATTENTION
from rlax.sampler.rows import BUDGET, EOS, FINISH_REASONS, LENGTH, STOP, SampleOutput, concat_outputs, row_key_data
from rlax.sampler.strategies import Greedy, SamplingMethod, Temperature, TopK, TopP
from rlax.sampler.stream import FinishedGroup, Stream
