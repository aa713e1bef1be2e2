"""Rollouts: host-side packing, the bounded staleness queue, the producer thread, and the SFT warm start."""

from rlax.rollout.packing import concat, empty_batch, pack, take_rows
from rlax.rollout.text import completions, strategy, text_generate_fn, to_host
from rlax.rollout.queue import Closed, Rollout, RolloutQueue
