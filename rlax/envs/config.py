"""The `env` config section. It imports nothing from rlax.envs, so the protocol (rlax.envs.base), the registry
and the environments can all import it without a circle; whether `name` is registered is checked by
rlax.config, which sees the registry."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EnvConfig:
  """Multi-turn episodes. name: "" (one-shot rollouts), a registered environment ("single_turn",
  "calculator", "retry", "search") or "module:Class" (a user's Environment, built as Class(ctx: EnvContext) per
  episode). The retrieval fields build the run's one retrieval service (rlax.envs.retrieval) where `retriever` is
  set; the search environment's searches per episode are `max_tool_calls`, each under `tool_timeout_s`."""
  name: str = ""
  renderer: str = "auto"          # chat-template family: "auto" (from the template), chatml, llama3, hermes
  max_turns: int = 4              # policy turns per episode
  max_tool_calls: int = 4         # tool calls per episode
  turn_tokens: int = 0            # new tokens per turn (0: rollout.max_new_tokens, clamped to the context left)
  context_tokens: int = 0         # prompt + all turns (0: rollout.max_prompt_len + rollout.max_new_tokens)
  tool_timeout_s: float = 5.0     # per call, in a verifier process
  tool_output_chars: int = 1000   # longer tool output is cut (counted as "truncated")
  tools_available: bool = True    # False: every call is answered "unavailable" (a control run)
  examples: int = 2               # calculator: worked examples in the conversation
  retry_message: str = "That is not right. Think again and give the answer."  # retry: the user's reply
  retriever: str = ""             # "bm25" (over `corpus`), an http(s):// Search-R1 server, "module:fn"; "": none
  corpus: str = ""                # .jsonl/.parquet/datasets dir of id/title/text, or "module:fn" giving passages
  top_k: int = 3                  # passages per search
  passage_chars: int = 300        # each passage's text cut to this
  retrieval_window_ms: float = 5.0  # searches that arrive within it share one retriever call

  @property
  def episodic(self) -> bool:
    """Rollouts are an environment's episodes (any name): the sampler compiles its extensions and batches keep
    forks. Read by the sampler's warm-up, the memory estimate and the batch template."""
    return bool(self.name)

  def validate(self) -> "EnvConfig":
    for name, ok in (("max_turns", self.max_turns >= 1), ("max_tool_calls", self.max_tool_calls >= 0),
                     ("turn_tokens", self.turn_tokens >= 0), ("context_tokens", self.context_tokens >= 0),
                     ("tool_timeout_s", self.tool_timeout_s > 0), ("tool_output_chars", self.tool_output_chars >= 1),
                     ("examples", self.examples >= 0), ("top_k", self.top_k >= 1),
                     ("passage_chars", self.passage_chars >= 1),
                     ("retrieval_window_ms", self.retrieval_window_ms >= 0)):
      if not ok:
        raise ValueError(f"env.{name}={getattr(self, name)!r} is out of range")
    if self.renderer not in ("auto", "chatml", "hermes", "llama3"):
      raise ValueError(f"env.renderer={self.renderer!r}: use auto, chatml, hermes or llama3")
    return self
