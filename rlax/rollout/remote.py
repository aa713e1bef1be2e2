"""Rollouts between processes: the sampler process sends each packed batch, the trainer process queues it.

A multi-process job without Pathways runs the rollout producer in the process that owns the sampler's
devices and the trainer in the one that owns the trainer's. A packed `RolloutBatch` is numpy on the host
already, so it travels as bytes over the coordination service's key-value store (`rlax.multihost.Channel`),
keyed by batch index, and the trainer places it on its mesh with its one `device_put`.
"""

from __future__ import annotations

import dataclasses
import io
import json
import threading
from typing import Callable, Optional

import numpy as np

from rlax.rollout.queue import Closed, Rollout, RolloutQueue
from rlax.trainer.batch import RolloutBatch

_FIELDS = [f.name for f in dataclasses.fields(RolloutBatch) if f.name != "prompt_len"]


def encode(r: Rollout) -> bytes:
  """One rollout as bytes: the batch's arrays (None fields left out) and a JSON header."""
  arrays = {k: np.asarray(getattr(r.data, k)) for k in _FIELDS if getattr(r.data, k) is not None}
  head = dict(index=r.index, version=r.version, stats=r.stats, data_state=r.data_state,
              prompt_len=r.data.prompt_len)
  buf = io.BytesIO()
  np.savez(buf, __head__=np.frombuffer(json.dumps(head).encode(), np.uint8), **arrays)
  return buf.getvalue()


def decode(data: bytes) -> Rollout:
  with np.load(io.BytesIO(data)) as z:
    head = json.loads(z["__head__"].tobytes().decode())
    arrays = {k: z[k] for k in z.files if k != "__head__"}
  batch = RolloutBatch(prompt_len=head["prompt_len"], **arrays)
  return Rollout(head["index"], head["version"], batch, head["stats"], head["data_state"])


class RemoteSink:
  """Producer side: `sink(rollout)` publishes it under `rollout/<index>`."""

  def __init__(self, channel):
    self.channel = channel

  def __call__(self, r: Rollout) -> None:
    self.channel.set_bytes(f"rollout/{r.index}", encode(r))


class RemoteSource:
  """Trainer side: a thread that moves rollouts first..end-1 from the channel into `queue`, in order."""

  def __init__(self, channel):
    self.channel = channel
    self.error: Optional[BaseException] = None
    self._thread: Optional[threading.Thread] = None

  def start(self, first: int, end: int, queue: RolloutQueue, on_error: Callable[[], None]) -> None:
    def body():
      try:
        for s in range(first, end):
          queue.put(decode(self.channel.get_bytes(f"rollout/{s}")))
      except Closed:
        pass
      except BaseException as e:
        self.error = e
        on_error()
    self._thread = threading.Thread(target=body, daemon=True, name="rollout-receiver")
    self._thread.start()

  def join(self, timeout: float = 60.0) -> None:
    if self._thread is not None:
      self._thread.join(timeout=timeout)
