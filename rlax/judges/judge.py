"""A generative judge: a frozen model that reads each reply and writes a verdict, which becomes the reward.

    judge = Judge.load(run.judge, mesh=mesh, slots=64, log_path=".../logs/judge.jsonl")
    graded = judge.grade(reward_fn, texts, records)      # [(reward in [0, 1], info)], as VerifierPool.grade

It generates through rlax's own engine (`rlax.sampler.Sampler`, greedy, on the sampler's mesh or its own:
rlax.services), the replies of one `grade` call as one batch (a step's rollouts, or an evaluation's). The reply
is environment content: it enters the judge's chat prompt as plain text (`Renderer.prompt`), never as control
tokens, cut to fit `max_prompt_len`. Replies not judged by the batch's deadline, and verdicts the parser cannot
read, get reward 0 and are counted (`info["metrics"]`, averaged into the step's `reward/*` metrics), never an
exception.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Optional, Sequence

from rlax.envs import renderers
from rlax.judges import verdicts
from rlax.judges.config import JudgeConfig
from rlax.models import hf
from rlax.sampler import Sampler, strategies, warmup
from rlax.sampler.rows import LENGTH

CUT = " [...]"  # marks a reply cut to fit the judge's prompt
CHARS_PER_TOKEN = 16  # a reply is cut to max_prompt_len x this many characters before it is tokenized at all
LOG_CHARS = 2000  # of a reply and of a verdict, in the sample log


def question_of(record) -> str:
  """What the reply answers: the record's prompt, or its last user message."""
  if getattr(record, "prompt", ""):
    return record.prompt
  users = [m.get("content", "") for m in getattr(record, "messages", ()) or () if m.get("role") == "user"]
  return users[-1] if users else ""


USES = ((1, strategies.Greedy()),)  # the engine's (samples per group, strategy): one greedy verdict a reply
# Never new weights (no recompute program), a batch at a time (no smaller decode), few admission sizes.
_SIZES = dict(on_swap="keep", shrink=False, admit_factor=4, prompt_factor=2)


def engine(config: JudgeConfig, model_cfg, mesh, *, slots: int, params=None, eos_id=None, pad_id: int = 0,
           **kw) -> Sampler:
  """The judge's sampling engine (`_SIZES`), a short verdict in one decode chunk. Callers: Judge, launch.plan
  (`kw`: its memory budget)."""
  return Sampler(model_cfg, mesh, max_prompt_len=config.max_prompt_len, max_new_tokens=config.max_new_tokens,
                 slots=slots, eos_id=eos_id, pad_id=pad_id, params=params, decode_chunk=min(config.max_new_tokens, 16),
                 **_SIZES, **kw)


def sizes(config: JudgeConfig, slots: int) -> warmup.Sizes:
  """The judge engine's compiled sizes without building it: it never shrinks, so neither its mesh's row shards
  nor its cache layout change them. rlax.compiled counts the programs of their warm-up."""
  assert not _SIZES["shrink"]
  return warmup.sizes(slots, 1, paged=False, max_prompt_len=config.max_prompt_len,
                      max_new_tokens=config.max_new_tokens, **_SIZES)


class Judge:
  """Params on `mesh` behind a greedy `Sampler` of `slots` rows; see the module docstring."""

  def __init__(self, config: JudgeConfig, model_cfg, params, tokenizer, mesh=None, *, slots: int,
               log_path: Optional[str] = None):
    self.config, self.tokenizer, self.log_path = config, tokenizer, log_path
    self.parser = verdicts.Parser(config.verdict, config.labels, config.scale)
    self.template = config.template_text()
    self.render = renderers.renderer("auto", tokenizer)
    self.engine = engine(config, model_cfg, mesh, slots=slots, params=params, eos_id=tokenizer.eos_ids,
                         pad_id=tokenizer.pad_id)
    self._lock = threading.Lock()  # one batch at a time: training and evaluation share the engine
    self.batches = 0

  @classmethod
  def load(cls, config: JudgeConfig, *, mesh=None, slots: int, dtype=None, log_path: Optional[str] = None) -> "Judge":
    cfg, params = hf.load_checkpoint(config.hf_checkpoint, mesh=mesh, dtype=dtype)
    return cls(config, cfg, params, hf.load_tokenizer(config.hf_checkpoint), mesh, slots=slots, log_path=log_path)

  def warm_up(self) -> None:
    """Compiles the engine's programs before the first batch."""
    self.engine.warm_up(self.engine.weights.latest()[0], USES)

  def prompt(self, reply: str, record) -> tuple[list[int], bool]:
    """(the judge's prompt ids for `reply` to `record`, whether the reply was cut to fit); ids longer than
    `max_prompt_len` (a question too long on its own) come back as they are, for the caller to refuse."""
    answer = getattr(record, "answer", None)
    values = dict(rubric=self.config.rubric, question=question_of(record),
                  reference="" if answer is None else str(answer))
    # the default template's delimiters, written by the reply, would close its quote early
    reply = reply[:self.config.max_prompt_len * CHARS_PER_TOKEN].replace("<reply>", "< reply>").replace(
        "</reply>", "</ reply>")
    ids_of = lambda r: self.render.prompt([{"role": "user", "content": verdicts.fill(self.template, reply=r,
                                                                                       **values)}])
    ids = ids_of(reply)
    cut, budget = False, self.config.max_prompt_len
    reply_ids = self.tokenizer.encode(reply, add_special_tokens=False, special=False)
    for _ in range(3):  # a cut re-tokenizes a little differently: tighten until it fits
      if len(ids) <= budget:
        break
      keep = max(0, len(reply_ids) - (len(ids) - budget) - len(CUT))
      reply_ids, cut = reply_ids[:keep], True
      ids = ids_of(self.tokenizer.decode(reply_ids) + CUT)
    return ids, cut

  def grade(self, fn, texts: Sequence[str], records: Sequence[Any], timeout_s=None, in_process=None):
    """[(reward, info)] of each reply, judged as one batch (`fn`, the run's reward entry, is the judge itself)."""
    del fn, timeout_s, in_process
    t0 = time.perf_counter()
    prompts, cuts, out = [], [], [None] * len(texts)
    for i, (text, record) in enumerate(zip(texts, records)):
      ids, cut = self.prompt(text, record)
      if len(ids) > self.config.max_prompt_len:
        out[i] = self._result(0.0, "", failed=True, reason=f"the judge's prompt has {len(ids)} tokens with the reply "
                              f"cut; judge.max_prompt_len is {self.config.max_prompt_len}")
      else:
        prompts.append((i, ids))
      cuts.append(cut)
    with self._lock:  # the deadline runs from here: a batch waiting for another is not late
      verdicts_ = self._generate([ids for _, ids in prompts], time.perf_counter() + self.config.timeout_s)
      for (i, _), said in zip(prompts, verdicts_):
        if said is None:
          out[i] = self._result(0.0, "", timeout=True, reason=f"not judged within judge.timeout_s="
                                f"{self.config.timeout_s}")
        elif said[1]:  # stopped by max_new_tokens: what it was about to say may change the verdict (or quote the reply)
          out[i] = self._result(0.0, said[0], failed=True, reason="the verdict ran past judge.max_new_tokens")
        else:
          reward, ok = self.parser.parse(said[0])
          out[i] = self._result(reward, said[0], failed=not ok, reason="" if ok else "unparseable verdict")
      rate = len(texts) / max(time.perf_counter() - t0, 1e-9)
      for (reward, info), cut in zip(out, cuts):
        info["metrics"].update(judge_cut=float(cut), judged_per_s=rate)
      self._log(texts, records, out)
      self.batches += 1
    return out

  def _generate(self, prompts: list[list[int]], deadline: float) -> list[Optional[tuple[str, bool]]]:
    """(greedy verdict, whether max_new_tokens stopped it) of each of `prompts` (None: not finished by
    `deadline`, perf_counter seconds)."""
    if not prompts:
      return []
    stream = self.engine.stream(USES[0][1])
    stream.submit(prompts, tags=range(len(prompts)))
    done = {}
    while stream.pending and time.perf_counter() < deadline:
      for g in stream.step():
        done[g.tag] = (self.tokenizer.decode(g.out.tokens[0][:int(g.out.lengths[0])]),
                       int(g.out.finish_reason[0]) == LENGTH)
    return [done.get(i) for i in range(len(prompts))]

  @staticmethod
  def _result(reward: float, said: str, *, failed: bool = False, timeout: bool = False, reason: str = ""):
    info = {"judge": said[:LOG_CHARS], "metrics": {"judge_failed": float(failed), "judge_timeout": float(timeout)}}
    if reason:
      info["reason"] = reason
    return float(reward), info

  def _log(self, texts, records, out) -> None:
    n = min(self.config.log_samples, len(texts))
    if not self.log_path or not n:
      return
    with open(self.log_path, "a", encoding="utf-8") as f:
      for text, record, (reward, info) in zip(texts[:n], records[:n], out[:n]):
        f.write(json.dumps({"batch": self.batches, "record": str(getattr(record, "id", "")),
                            "reply": text[:LOG_CHARS], "verdict": info["judge"], "reward": reward,
                            **{k: v for k, v in info["metrics"].items() if k != "judged_per_s"}}) + "\n")


class JudgeReward:
  """`reward.name="judge"`: the run's reward entry, graded by the judge the sampler's role loads on its mesh
  (`judge`, replaced when that mesh is: rlax.services). `VerifierPool.grade` hands it whole batches (`grade_batch`)."""

  def __init__(self, judge: Optional[Judge] = None):
    self.judge = judge

  def grade_batch(self, texts: Sequence[str], records: Sequence[Any]) -> list[tuple[float, dict]]:
    if self.judge is None:
      raise RuntimeError("reward.name='judge': no judge is loaded (the sampler's role loads it with the sampler)")
    return self.judge.grade(self, texts, records)

  def __call__(self, text: str, record) -> tuple[float, dict]:
    return self.grade_batch([text], [record])[0]
