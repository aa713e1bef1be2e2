"""Rollouts: host-side packing, the bounded staleness queue, the producer thread, and the SFT warm start."""

from rlax.rollout.packing import (completions, concat, empty_batch, pack, strategy, take_rows,
                                  text_generate_fn, to_host)
from rlax.rollout.queue import Closed, Rollout, RolloutQueue
