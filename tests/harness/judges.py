"""A judge whose verdict is known: a tiny model programmed to write one word whatever it reads."""

import torch

from configs import base
from harness import hf_models
from rlax.judges import Judge, JudgeConfig
from rlax.models import hf


def programmed(path, word: str, record, **judge_fields):
  """A Qwen-style judge that writes `word` after any prompt and stops: every layer's output projections are 0, so
  the residual stream is the current token's embedding, and the head maps each token of the chain (the
  generation header's last token, then the word's tokens) to the next, then to eos."""
  hf_models.make_dir(path, "qwen2", tie=False, seed=0)
  tok = hf.load_tokenizer(str(path))
  probe = Judge(JudgeConfig(**judge_fields), hf.read_config(str(path)), None, tok, slots=1)  # for its prompt()
  chain = [probe.prompt("x", record)[0][-1], *tok.encode(word, add_special_tokens=False), tok.eos_ids[0]]
  assert len(set(chain)) == len(chain), chain
  model = hf_models.reload(path)
  d = model.config.hidden_size
  basis = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(0)))[0].T  # orthonormal rows
  with torch.no_grad():
    for layer in model.model.layers:
      layer.self_attn.o_proj.weight.zero_()
      layer.mlp.down_proj.weight.zero_()
    model.model.norm.weight.fill_(1.0)
    model.lm_head.weight.zero_()
    for k, (a, b) in enumerate(zip(chain, chain[1:])):
      model.model.embed_tokens.weight[a] = basis[k] * d ** 0.5  # rms 1: the final norm passes it unchanged
      model.lm_head.weight[b] = basis[k] * 10.0
  model.save_pretrained(path)


TEMPLATE = "q: {question}\na: {reply}"


def run_config(tmp_path):
  """A judged run's config on one-device slices: the tiny policy in tmp_path/policy, a programmed judge in
  tmp_path/judge (labels "four" = 1, "hi" = 0), tmp_path/train.jsonl."""
  c = base.get_config()
  c.workdir = str(tmp_path / "run")
  c.model.hf_checkpoint = str(tmp_path / "policy")
  c.model.overrides = dict(dtype="float32")
  c.topology.update(slice_size=1, trainer_slices=1, sampler_slices=1)
  c.rollout.update(prompts_per_step=2, samples_per_prompt=2, max_prompt_len=24, max_new_tokens=6)
  c.controller.update(steps=2, max_staleness=1)
  c.data.update(train_files=str(tmp_path / "train.jsonl"), n_eval=2)
  c.eval.n_samples = 2
  c.reward.name = "judge"
  c.judge.update(hf_checkpoint=str(tmp_path / "judge"), template=TEMPLATE, verdict="label", labels="four=1,hi=0",
                 max_prompt_len=96, max_new_tokens=4)
  return c
