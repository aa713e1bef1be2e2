"""Episodes that end while a batch grades are graded together in the next batch, each getting its own result;
a grader's error reaches every episode of its batch and none after it; a cancelled episode leaves the rest be."""

import asyncio
import time

import pytest

from rlax.envs import grading


def _reward(text, record):
  if text == "boom":
    raise RuntimeError("grader failed")
  return float(len(text)), {"record": record}


def test_episodes_ending_together_are_graded_in_batches():
  batches = []

  def grade_fn(fn, texts, records):
    batches.append(list(texts))
    time.sleep(0.05)  # a judge call: episodes ending meanwhile wait for the next batch
    return [fn(t, r) for t, r in zip(texts, records)]

  async def episode(i):
    await asyncio.sleep(0.01 * i)
    return await grading.grade(grade_fn, _reward, "x" * i, i)

  async def run():
    return await asyncio.gather(*(episode(i) for i in range(12)))

  assert asyncio.run(run()) == [(float(i), {"record": i}) for i in range(12)]
  assert sorted(t for b in batches for t in b) == ["x" * i for i in range(12)]
  assert len(batches) < 12 and max(map(len, batches)) > 1, batches


def test_a_failed_batch_fails_its_episodes_only():
  def grade_fn(fn, texts, records):
    return [fn(t, r) for t, r in zip(texts, records)]

  def short(fn, texts, records):
    return [(0.0, {})]

  async def run():
    together = await asyncio.gather(grading.grade(grade_fn, _reward, "boom", 0),
                                    grading.grade(grade_fn, _reward, "ok", 1), return_exceptions=True)
    after = await grading.grade(grade_fn, _reward, "fine", 2)
    miscounted = await asyncio.gather(grading.grade(short, _reward, "a", 0), grading.grade(short, _reward, "b", 1),
                                      return_exceptions=True)
    return together, after, miscounted

  together, after, miscounted = asyncio.run(run())
  assert all(isinstance(x, RuntimeError) for x in together)  # graded as one batch: the grader raised for it
  assert after == (4.0, {"record": 2})
  assert all(isinstance(x, ValueError) and "2 replies gave 1 results" in str(x) for x in miscounted)


def test_a_cancelled_episode_leaves_its_batch_be():
  def grade_fn(fn, texts, records):
    time.sleep(0.05)
    return [fn(t, r) for t, r in zip(texts, records)]

  async def run():
    first = asyncio.ensure_future(grading.grade(grade_fn, _reward, "aa", 0))
    second = asyncio.ensure_future(grading.grade(grade_fn, _reward, "bbb", 1))
    await asyncio.sleep(0.01)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
      await first
    return await second

  assert asyncio.run(run()) == (3.0, {"record": 1})
