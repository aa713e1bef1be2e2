"""The environments rlax ships: one-shot answers as one-turn episodes, a tool-using environment built from
plain functions, and the calculator task.

`ToolEnv` runs the loop a tool-using agent needs: parse each sampled turn for calls (the renderer's format),
run them in the verifier processes, append their output as an environment turn, and end the episode at the
policy's final answer (a turn with no call), at `max_turns`, at `max_tool_calls` or when the context is full.
The reward reads only the policy's last turn, never a tool's output, and is 0 unless the episode ended with
a final answer: a calculator's result alone earns nothing. `RetryEnv` answers a wrong answer with a user
turn asking for another try. Where the template is not append-only for the environment's turn, the
conversation is re-rendered as the prompt of the episode's next row (rlax.envs.episodes).
"""

from __future__ import annotations

from typing import Sequence

from absl import logging

from rlax.envs import grading
from rlax.envs import renderers
from rlax.envs import tools as tools_lib
from rlax.envs.base import EnvContext, Environment, Observation, StepResult, Turn


class SingleTurnEnv(Environment):
  """A one-shot task as a one-turn episode: the run's rendered prompt, the run's reward on the reply."""

  def __init__(self, ctx: EnvContext):
    self.ctx = ctx
    self.record = None

  async def reset(self, record) -> Observation:
    self.record = record
    return Observation(self.ctx.render.encode(record))

  async def step(self, turn: Turn) -> StepResult:
    reward, info = await grade(self.ctx, self.ctx.tokenizer.decode(turn.tokens), self.record)
    return StepResult(reward=reward, done=True, stop_reason="final_answer" if turn.finish_reason != "length"
                      else "length", info=info)


async def grade(ctx: EnvContext, text: str, record) -> tuple[float, dict]:
  """The run's reward on `text`, graded off the event loop in a batch with the episodes ending beside it."""
  return await grading.grade(ctx.grade, ctx.reward_fn, text, record)


class ToolEnv(Environment):
  """A conversation with tools; see the module docstring. Subclasses (or callers) give `messages(record)`,
  the first conversation, and may override `final_reward`."""

  def __init__(self, ctx: EnvContext, tools: Sequence[tools_lib.Tool], calls=None, system: str = ""):
    cfg = ctx.config
    self.ctx, self.cfg, self.system = ctx, cfg, system
    self.render = renderers.renderer(cfg.renderer, ctx.tokenizer, calls)
    if not self.render.append_only:
      logging.log_first_n(logging.INFO, "the chat template drops or rewrites a policy turn when a tool turn "
                          "follows it: each tool turn starts a new row of the episode, its prompt re-rendered", 1)
    self.runner = tools_lib.ToolRunner(ctx.pool, tools, timeout_s=cfg.tool_timeout_s,
                                       output_chars=cfg.tool_output_chars, available=cfg.tools_available,
                                       journal=ctx.journal)
    self.record, self.turns, self.calls, self.conversation, self.schemas = None, 0, 0, [], None

  def messages(self, record) -> list[dict]:
    msgs = [dict(m) for m in record.messages] if record.messages else [{"role": "user", "content": record.prompt}]
    if self.system and not any(m["role"] == "system" for m in msgs):
      msgs.insert(0, {"role": "system", "content": self.system})
    return msgs

  async def reset(self, record) -> Observation:
    self.record, self.turns, self.calls = record, 0, 0
    self.schemas = [t.schema() for t in self.runner.tools.values()] if isinstance(self.render.calls,
                                                                                  renderers.JsonCalls) else None
    self.conversation = self.messages(record)
    return Observation(self.render.prompt(self.conversation, self.schemas))

  async def final_reward(self, text: str) -> tuple[float, dict]:
    return await grade(self.ctx, text, self.record)

  async def run_calls(self, calls, key) -> list[tools_lib.ToolResult]:
    """One turn's calls, one result each (the runner's; a subclass may watch them)."""
    return await self.runner.run(calls, key=key)

  async def step(self, turn: Turn) -> StepResult:
    self.turns += 1
    text = self.ctx.tokenizer.decode(turn.tokens)
    parsed = self.render.calls.parse(text)
    if turn.finish_reason in ("length", "budget"):  # cut off mid-turn: no answer, no call to trust
      return StepResult(done=True, stop_reason="context_full" if turn.context_left < 1 else "length")
    if parsed.final:
      reward, info = await self.final_reward(text)
      return StepResult(reward=reward, done=True, stop_reason="final_answer", info=info)
    outcomes = ["parse_error"] * len(parsed.errors)
    if self.turns >= self.cfg.max_turns:
      return StepResult(done=True, stop_reason="max_turns", calls=outcomes)
    if self.calls + len(parsed.calls) > self.cfg.max_tool_calls:
      return StepResult(done=True, stop_reason="max_tool_calls", calls=outcomes)
    self.calls += len(parsed.calls)
    results = await self.run_calls(parsed.calls, turn.key)
    outcomes += [r.outcome for r in results]
    parts = [f"error: {e}" for e in parsed.errors] + [r.output for r in results]
    return self.answer(text, parts, "tool", turn, calls=outcomes)

  def answer(self, text: str, parts: Sequence[str], role: str, turn: Turn, **kw) -> StepResult:
    """The environment's turn (`parts` as `role` messages) after the policy's `text`: tokens to append, or
    the re-rendered conversation (a template not append-only here), or the episode's end when it cannot fit."""
    self.conversation = self.conversation + [self.render.message(text)]
    nxt = self.render.next_turn(self.conversation, parts, role, after_eos=turn.finish_reason == "eos",
                                tools=self.schemas)
    self.conversation += [{"role": role, "content": p} for p in parts]
    if "tokens" in nxt and len(nxt["tokens"]) + 1 > turn.context_left:
      return StepResult(done=True, stop_reason="context_full", **kw)
    return StepResult(**nxt, **kw)


class RetryEnv(ToolEnv):
  """Answer, hear that it was wrong, try again: a turn whose reward is below 0.5 is answered by a user turn
  (`env.retry_message`) until `max_turns`; the reward is the last turn's. On a template that drops earlier
  reasoning before a new user turn (Qwen3's) each retry is a new row of the episode."""

  def __init__(self, ctx: EnvContext):
    super().__init__(ctx, [])

  async def step(self, turn: Turn) -> StepResult:
    self.turns += 1
    text = self.ctx.tokenizer.decode(turn.tokens)
    if turn.finish_reason in ("length", "budget"):
      return StepResult(done=True, stop_reason="context_full" if turn.context_left < 1 else "length")
    reward, info = await self.final_reward(text)
    if reward >= 0.5 or self.turns >= self.cfg.max_turns:
      return StepResult(reward=reward, done=True, stop_reason="final_answer" if reward >= 0.5 else "max_turns",
                        info=info)
    return self.answer(text, [self.cfg.retry_message], "user", turn)


CALCULATOR_SYSTEM = ("You can use a calculator. To compute something, reply with only <calc>expression</calc>, "
                     "for example <calc>12*34</calc>, and the calculator answers with the result. When you know "
                     "the result, reply with the final answer: 'The answer is N.'")


class CalculatorEnv(ToolEnv):
  """Multiplication with a calculator tool called as `<calc>a*b</calc>` (SmolLM2's template has no tool
  block), answered by a tool turn; `env.examples` worked examples precede the problem. The reward: the last
  turn's final answer (the last number) equals the reference."""

  EXAMPLES = ((34, 56), (71, 23), (45, 89), (62, 17))

  def __init__(self, ctx: EnvContext):
    super().__init__(ctx, [tools_lib.Tool.from_function(tools_lib.calculator)],
                     calls=renderers.TagCalls({"calc": "calculator"}), system=CALCULATOR_SYSTEM)

  def messages(self, record) -> list[dict]:
    msgs = [{"role": "system", "content": self.system}]
    for a, b in self.EXAMPLES[:self.cfg.examples]:
      msgs += [{"role": "user", "content": f"What is {a} * {b}?"},
               {"role": "assistant", "content": f"<calc>{a}*{b}</calc>"},
               {"role": self.render.tool_role, "content": str(a * b)},
               {"role": "assistant", "content": f"The answer is {a * b}."}]
    return msgs + [{"role": "user", "content": record.prompt}]
