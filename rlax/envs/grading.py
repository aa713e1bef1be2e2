"""Final rewards of the episodes on one event loop, graded in batches: while a batch grades, the episodes that end
meanwhile queue, and the next batch takes them all. A reward that reads whole batches (a judge: one engine call
per batch) and the verifier pool (its workers in parallel) both gain; an episode waits for at most the batch
before its own. Caller: rlax.envs.tool_env.grade (every environment's final reward)."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, Callable

# loop → {(grade, reward_fn): the requests waiting for the next batch}; a closed stream's loop drops its entry
_QUEUES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict]" = weakref.WeakKeyDictionary()


async def grade(grade_fn: Callable, reward_fn: Any, text: str, record) -> tuple[float, dict]:
  """`grade_fn(reward_fn, texts, records)`'s (reward, info) for `text`, graded with the requests of the same loop
  and reward that wait beside it."""
  loop = asyncio.get_running_loop()
  queues = _QUEUES.setdefault(loop, {})
  key = (grade_fn, reward_fn)
  fut = loop.create_future()
  if key not in queues:
    queues[key] = []
    loop.create_task(_drain(queues, key))
  queues[key].append((text, record, fut))
  return await fut


async def _drain(queues: dict, key) -> None:
  grade_fn, reward_fn = key
  await asyncio.sleep(0)  # the turns handed over together join the first batch
  while queues[key]:
    batch, queues[key] = queues[key], []
    try:
      results = await asyncio.to_thread(grade_fn, reward_fn, [b[0] for b in batch], [b[1] for b in batch])
      if len(results) != len(batch):
        raise ValueError(f"grading {len(batch)} replies gave {len(results)} results")
    except Exception as e:  # pylint: disable=broad-except  # each episode of the batch gets the grader's error
      results = [e] * len(batch)
    for (_, _, fut), result in zip(batch, results):
      if fut.done():  # an episode cancelled meanwhile
        continue
      if isinstance(result, Exception):
        fut.set_exception(result)
      else:
        fut.set_result(result)
  del queues[key]
