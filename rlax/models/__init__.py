"""Transformer family (Llama 3, Qwen2/2.5, Qwen3), sharding rules, HF interop and chunked log-probs."""

from rlax.models.config import ModelConfig, MoEConfig, RopeScaling, from_dict, preset
from rlax.models.logprobs import logprobs_from_hidden, token_logprobs
from rlax.models.sharding import RULES, constrain, make_mesh, spec_for, tree_shardings
from rlax.models.transformer import (KVCache, Params, cache_bytes, forward, hidden_states, init_cache,
                                     init_params, lm_head, logits_from_hidden, param_axes, param_shapes)
from rlax.models.init import create_params, param_shardings
from rlax.models.nnx_model import Transformer
