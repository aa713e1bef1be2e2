"""A tiny model and rollout batch shared by the trainer tests."""

import jax
import jax.numpy as jnp
import numpy as np

from rlax import models as M
from rlax.trainer import RolloutBatch, SFTBatch, response_loss_mask

CFG = M.ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4, mlp_dim=32)
B, T, G, PROMPT = 8, 10, 4, 5


@jax.jit
def logprobs(params, tokens, input_mask):
  return M.token_logprobs(params, CFG, tokens, input_mask=input_mask)


def make_batch(params, seed: int = 0, rewards=None) -> RolloutBatch:
  """8 rows (2 groups of 4): left-padded prompts of 5 slots, right-padded responses, one 1-token response."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, CFG.vocab_size, (B, T)).astype(np.int32)
  mask = np.ones((B, T), bool)
  mask[0, :2] = False          # left padding of a short prompt
  mask[1, -3:] = False         # short response
  mask[2, PROMPT + 1:] = False  # one-token response
  tokens[~mask] = 0
  lm = response_loss_mask(mask, PROMPT)
  behaviour = logprobs(params, jnp.asarray(tokens), jnp.asarray(mask))
  if rewards is None:
    rewards = rng.integers(0, 2, B).astype(np.float32)
  return RolloutBatch(tokens=jnp.asarray(tokens), input_mask=jnp.asarray(mask), loss_mask=jnp.asarray(lm),
                      behaviour_logprobs=behaviour, rewards=jnp.asarray(rewards, jnp.float32),
                      versions=jnp.zeros(B, jnp.int32), group_ids=jnp.asarray(np.arange(B) // G, jnp.int32))


def sft_batch(seed: int = 0) -> SFTBatch:
  b = make_batch(M.create_params(CFG), seed)
  return SFTBatch(tokens=b.tokens, input_mask=b.input_mask, loss_mask=b.loss_mask)


def host(tree):
  return jax.tree.map(np.asarray, tree)
