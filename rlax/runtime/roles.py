"""The handshake between the trainer process and the sampler process of a multi-process job.

    trainer                                   sampler
    send_start(Start(...))          ──────→   recv_start()   set the data position, wait for weights
    send_eval("before", res)        ──────→   (the sampler evaluates; the trainer receives: recv_eval)
    send_end(End(evaluate))         ──────→   recv_end()

The sampler process evaluates (it holds the sampler) and sends each result; the trainer process receives it.
This is the one place that knows the channel's keys and their JSON encoding.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from rlax.multihost import Channel


@dataclasses.dataclass(frozen=True)
class Start:
  """step: the trained step the run starts from (its weights are pushed as that version); first: the first
  batch the sampler produces (after the rollouts a checkpoint kept); data: the data position to continue from
  (None: from the top); evaluate: whether the sampler evaluates the starting policy ("before")."""
  step: int
  first: int
  data: Optional[dict]
  evaluate: bool


@dataclasses.dataclass(frozen=True)
class End:
  """evaluate: whether the sampler evaluates the final weights ("after")."""
  evaluate: bool


class Handshake:
  """Typed messages over a coordination-service `Channel`. Without one (a one-process run: both roles in
  this process) there is no one to tell: sends do nothing."""

  def __init__(self, channel: Optional[Channel]):
    self.channel = channel

  def _send(self, key: str, value: dict) -> None:
    if self.channel is not None:
      self.channel.set_json(key, value)

  def send_start(self, start: Start) -> None:
    self._send("start", dataclasses.asdict(start))

  def recv_start(self) -> Start:
    return Start(**self.channel.get_json("start"))

  def send_end(self, end: End) -> None:
    self._send("end", dataclasses.asdict(end))

  def recv_end(self) -> End:
    return End(**self.channel.get_json("end"))

  def send_eval(self, tag: str, res: dict) -> None:
    self._send(f"eval/{tag}", res)

  def recv_eval(self, tag: str) -> dict:
    return self.channel.get_json(f"eval/{tag}")
