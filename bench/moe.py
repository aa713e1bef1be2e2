"""A mixture-of-experts layer's MLP: the dropless grouped matmul (rlax.models.moe) against every expert computed
densely for every token, forward and forward+backward, in the same run.

    python bench/moe.py                                  # 8 experts, top-2, d 576, expert MLP 1536, 2048 tokens
    python bench/moe.py --experts=64 --top_k=8 --expert_mlp=256

`grouped`: the router's top-k, tokens sorted by expert, three grouped matmuls (`moe.grouped_matmul`: blocks of
one expert off TPU), combined by the routing weights (what a MoE policy runs). `ragged_dot`: the same with
`jax.lax.ragged_dot` (what TPU runs; XLA:CPU computes every group against every row). `dense`: each expert applied to all N tokens, combined with the same weights (zero
outside a token's top-k); the same values at E/k times the FLOPs. Each is reported as FLOP/s counting active
parameters only (2 x 3 x D x Fe x k per token forward, x3 with the backward), and as a share of this run's
f32 matmul rate (`workload.matmul_flops_per_s`). Medians of --reps after a warm-up. The last line is JSON.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import workload

from rlax import models as M
from rlax.models import moe

flags.DEFINE_integer("experts", 8, "routed experts")
flags.DEFINE_integer("top_k", 2, "experts per token")
flags.DEFINE_integer("expert_mlp", 1536, "expert MLP width")
flags.DEFINE_integer("tokens", 2048, "tokens through the layer")
flags.DEFINE_integer("reps", 5, "timed repetitions (median)")
FLAGS = flags.FLAGS


def _dense_all(w, x, experts, weights):
  """Every expert on every token, weighted (zero weight outside a token's top-k)."""
  share = jnp.sum(jax.nn.one_hot(experts, w["experts_gate"].shape[0], dtype=x.dtype) * weights[..., None], axis=1)
  g = jnp.einsum("nd,edf->enf", x, w["experts_gate"])
  u = jnp.einsum("nd,edf->enf", x, w["experts_up"])
  y = jnp.einsum("enf,efd->end", jax.nn.silu(g) * u, w["experts_down"])
  return jnp.einsum("end,ne->nd", y, share)


def main(_):
  cfg = M.ModelConfig(vocab_size=FLAGS.vocab, d_model=FLAGS.d_model, n_layers=1, n_heads=FLAGS.heads,
                      n_kv_heads=FLAGS.kv_heads, head_dim=FLAGS.head_dim, mlp_dim=FLAGS.expert_mlp, arch="mixtral",
                      moe=M.MoEConfig(FLAGS.experts, FLAGS.top_k, FLAGS.expert_mlp))
  rng = np.random.default_rng(0)
  E, D, F, N = FLAGS.experts, FLAGS.d_model, FLAGS.expert_mlp, FLAGS.tokens
  w = {"router": jnp.asarray(rng.standard_normal((D, E)) * 0.5, jnp.float32)}
  for name, shape in (("experts_gate", (E, D, F)), ("experts_up", (E, D, F)), ("experts_down", (E, F, D))):
    w[name] = jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[1]), jnp.float32)
  x = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
  _, experts, weights = jax.jit(lambda x: moe.route(cfg, w["router"], x))(x)

  ways = {"grouped": moe.expert_mlp, "dense": _dense_all,
          "ragged_dot": lambda w, x, e, g: moe.expert_mlp(w, x, e, g, matmul=jax.lax.ragged_dot)}
  fwd = {k: jax.jit(f) for k, f in ways.items()}
  bwd = {k: jax.jit(jax.grad(lambda w, x, f=f: jnp.sum(f(w, x, experts, weights) ** 2), argnums=(0, 1)))
         for k, f in ways.items()}
  diff = float(jnp.abs(fwd["grouped"](w, x, experts, weights) - fwd["dense"](w, x, experts, weights)).max())
  peak = workload.matmul_flops_per_s()
  active = 2.0 * 3 * D * F * FLAGS.top_k * N  # forward FLOPs of the active experts
  out = dict(experts=E, top_k=FLAGS.top_k, d_model=D, expert_mlp=F, tokens=N, max_abs_diff=diff,
             matmul_peak_flops_per_s=peak, backend=jax.default_backend())
  for k in ways:
    for phase, fns, flops in (("fwd", fwd, active), ("fwd_bwd", bwd, 3 * active)):
      s, _ = workload.median_time(lambda: jax.block_until_ready(fns[k](w, x, experts, weights) if phase == "fwd"
                                                                 else fns[k](w, x)), FLAGS.reps)
      out[f"{k}_{phase}_s"] = round(s, 5)
      out[f"{k}_{phase}_active_flops_per_s"] = round(flops / s, 1)
      out[f"{k}_{phase}_share_of_matmul"] = round(flops / s / peak, 4)
  for phase in ("fwd", "fwd_bwd"):
    for k in ("dense", "ragged_dot"):
      out[f"grouped_vs_{k}_{phase}"] = round(out[f"{k}_{phase}_s"] / out[f"grouped_{phase}_s"], 2)
  print(json.dumps(out))


if __name__ == "__main__":
  FLAGS.set_default("d_model", 576)
  app.run(main)
