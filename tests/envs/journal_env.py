"""A deterministic tool-using environment for the resume tests: turns 0 and 1 call the `note` tool (a side
effect: it appends the turn's key to the file $RLAX_TEST_TOOL_LOG), turn 2 is graded by the run's reward.
With $RLAX_TEST_KILL_AT="step", the controller SIGKILLs itself right after the first turn-1 call of that
step's batch returns (mid-episode, the call journaled)."""

import json
import os
import signal

from rlax import envs
from rlax.envs import renderers, tool_env, tools

LOG, KILL = "RLAX_TEST_TOOL_LOG", "RLAX_TEST_KILL_AT"


def note(key: str) -> str:
  """Appends `key` to the log file; answers with its length."""
  with open(os.environ[LOG], "a") as f:
    f.write(key + "\n")
  return str(len(key))


class Noting(envs.Environment):

  def __init__(self, ctx):
    self.ctx = ctx
    self.runner = tools.ToolRunner(ctx.pool, [tools.Tool.from_function(note)], journal=ctx.journal)

  async def reset(self, record):
    self.record = record
    return envs.Observation(self.ctx.render.encode(record), max_new_tokens=3)

  async def step(self, turn):
    if turn.index == 2:
      reward, _ = await tool_env.grade(self.ctx, self.ctx.tokenizer.decode(turn.tokens), self.record)
      return envs.StepResult(reward=reward, done=True, stop_reason="final_answer")
    key = json.dumps(list(turn.key) if turn.key else None, separators=(",", ":"))
    res, = await self.runner.run([renderers.ToolCall("note", {"key": key})], key=turn.key)
    if turn.key and os.environ.get(KILL) == str(turn.key[1]) and turn.index == 1:
      os.kill(os.getpid(), signal.SIGKILL)
    return envs.StepResult(tokens=self.ctx.tokenizer.encode(" =" + res.output, add_special_tokens=False),
                           max_new_tokens=3, calls=(res.outcome,))
