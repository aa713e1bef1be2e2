"""The README's custom environment, run as written: its tool is called through the verifier pool, the answer
appended under the template's role, and only the final turn graded."""

import asyncio
import os
import re
import sys

from rlax import envs, rewards
from rlax.data.records import Record

from chat_tokenizers import ids, tokenizer

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


def test_readme_environment_runs(tmp_path):
  code = re.search(r"```python\n(from rlax import envs.*?)```", open(README).read(), re.S).group(1)
  (tmp_path / "my_envs.py").write_text(code)
  sys.path.insert(0, str(tmp_path))
  tok = tokenizer("hermes")
  graded = []

  def grade(fn, texts, records):
    graded.append(texts[0])
    return [(float("5" in texts[0]), {})]

  with rewards.VerifierPool(num_workers=1, timeout_s=5) as pool:
    ctx = envs.EnvContext(tokenizer=tok, render=None, reward_fn=None, grade=grade, pool=pool,
                          config=envs.EnvConfig(name="my_envs:Lookup"))
    env = envs.get("my_envs:Lookup")(ctx)

    def turn(text, i):
      t = ids(tok, text) + [tok.backend.token_to_id("<|im_end|>")]
      return envs.Turn(tokens=t, logprobs=[0.0] * len(t), versions=[0] * len(t), finish_reason="eos", index=i,
                       context_left=1000)

    async def episode():
      obs = await env.reset(Record(id="r", prompt="How long is 'hello'?", answer="5"))
      call = await env.step(turn('<tool_call>\n{"name": "lookup", "arguments": {"word": "hello"}}\n</tool_call>', 0))
      end = await env.step(turn("It has 5 letters.", 1))
      return obs, call, end

    obs, call, end = asyncio.run(episode())
  assert '"name": "lookup"' in tok.decode(obs.tokens, skip_special_tokens=False)  # the schema in the prompt
  assert list(call.calls) == ["ok"] and not call.done
  assert tok.decode(call.tokens, skip_special_tokens=False) == (
      "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
  assert end.done and end.reward == 1.0 and end.stop_reason == "final_answer"
  assert graded == ["It has 5 letters."]  # the tool's "5" alone is never graded
