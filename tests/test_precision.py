"""Every (param_dtype, dtype) pair the run config accepts trains, pushes and generates end to end.

Per pair, on 8 fake CPU devices through the runtime's own builders: trainer on 4 devices (FSDP), sampler
on 2 others (data parallel). Push initial weights through the weights service, generate, pack the rollout,
fill reference log-probs, one RL step, push again. The sampler must hold compute-dtype weights equal to the
trainer's master weights cast, and every loss, metric and updated weight must be finite. A pair the config
cannot run must be refused by `config.load` with one line naming the field.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax import builders
from rlax import config as config_lib
from rlax import models
from rlax.rollout import packing
from rlax.rollout import text as rollout_text
from rlax.sampler import Temperature
from rlax.topology import build_topology

DTYPES = ("float32", "bfloat16", "float16")
MODEL = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64)
PROMPTS, G, P, N = 2, 4, 4, 4
# Mean |sampler log-prob - trainer log-prob| per scored token: the two programs differ (KV-cached decode vs
# full forward), so their rounding differs by about the compute dtype's resolution.
LOGP_TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


def _load(tmp_path, param_dtype, dtype):
  return config_lib.load(dict(
      workdir=str(tmp_path), model=dict(preset="w1", overrides=dict(MODEL, param_dtype=param_dtype, dtype=dtype)),
      topology=dict(slice_size=2, trainer_slices=2, sampler_slices=1, trainer_mesh=dict(data=1, fsdp=-1, tensor=1),
                    sampler_mesh=dict(data=-1, fsdp=1, tensor=1)),
      # lr small enough that most Adam updates fall below bf16's resolution: only f32 masters keep them.
      rollout=dict(prompts_per_step=PROMPTS, samples_per_prompt=G, max_prompt_len=P, max_new_tokens=N),
      optimizer=dict(lr=1e-5), algorithm=dict(name="grpo", kl_coef=0.04), eval=dict(n_samples=1),
      controller=dict(steps=2)))


def _check_sampler_weights(held, trainer_params, dtype, devices):
  for (path, w), t in zip(jax.tree.flatten_with_path(held)[0], jax.tree.leaves(trainer_params)):
    name = jax.tree_util.keystr(path)
    assert w.dtype == jnp.dtype(dtype), name
    assert set(w.sharding.device_set) <= devices, name
    np.testing.assert_array_equal(np.asarray(jax.device_get(w)), np.asarray(jax.device_get(t).astype(dtype)),
                                  err_msg=name)


def _finite(tree) -> bool:
  return all(bool(np.all(np.isfinite(np.asarray(jax.device_get(x), np.float32)))) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("param_dtype,dtype", list(itertools.product(DTYPES, DTYPES)))
def test_precision_pair_runs_end_to_end(tmp_path, param_dtype, dtype):
  try:
    run = _load(tmp_path, param_dtype, dtype)
  except ValueError as e:
    # Only float16 master weights may be refused (Adam's moments underflow in float16), in one line.
    assert param_dtype == "float16", f"config refused ({param_dtype}, {dtype}): {e}"
    assert "param_dtype" in str(e) and "\n" not in str(e), str(e)
    return
  topo = build_topology(run.topology)
  parts = builders.components(run, topo)
  trainer, sampler, weights = parts.trainer, parts.sampler, parts.weights
  sampler_devs = set(topo.sampler_mesh.devices.flat)
  assert not sampler_devs & set(topo.trainer_mesh.devices.flat)

  params = models.create_params(run.model, topo.trainer_mesh, seed=0)
  ref = jax.tree.map(jnp.copy, params)
  state = trainer.init_state(params)
  weights.push(state.params, 0)
  _check_sampler_weights(weights.latest()[0], state.params, dtype, sampler_devs)

  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, MODEL["vocab_size"], 3)) for _ in range(PROMPTS)]
  out = rollout_text.to_host(sampler.generate(prompts, samples_per_prompt=G, strategy=Temperature(1.0), seed=0,
                                         weights=weights))
  assert _finite(out.logprobs) and np.all(np.asarray(out.logprobs) <= 0)
  assert np.all((np.asarray(out.tokens) >= 0) & (np.asarray(out.tokens) < MODEL["vocab_size"]))
  batch = trainer.place(packing.pack(out, rng.integers(0, 2, PROMPTS * G).astype(np.float32), P))
  batch = batch.replace(ref_logprobs=trainer.ref_logprobs(ref, batch))
  before = jax.device_get(state.params)
  state, metrics = trainer.step(state, batch)
  metrics = jax.device_get(metrics)

  bad = sorted(k for k, v in metrics.items() if not np.isfinite(v))
  assert not bad, f"({param_dtype}, {dtype}): non-finite metrics {bad}; the config must refuse this pair"
  finite = _finite(state.params)
  assert finite, f"({param_dtype}, {dtype}): non-finite weights after one step; the config must refuse this pair"
  assert metrics["grad_norm"] > 0 and metrics["tokens"] > 0
  # The sampler's behaviour log-probs are the trainer's, up to the compute dtype's rounding.
  assert metrics["logp_diff_mean"] < LOGP_TOL[dtype], metrics["logp_diff_mean"]
  after = jax.device_get(state.params)
  assert all(a.dtype == jnp.dtype(param_dtype) for a in jax.tree.leaves(after))
  delta = [np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)) for a, b in
           zip(jax.tree.leaves(after), jax.tree.leaves(before))]
  assert any(np.any(d > 0) for d in delta)
  if param_dtype == "float32":
    # Master weights keep updates finer than bf16's resolution at their magnitude (the point of f32 masters).
    ulp = [np.abs(np.asarray(b, np.float32)) * 2.0 ** -8 for b in jax.tree.leaves(before)]
    assert sum(int(np.sum((d > 0) & (d < u))) for d, u in zip(delta, ulp)) > 0.5 * sum(d.size for d in delta)

  # The updated weights reach the sampler in the compute dtype, through the service and directly.
  weights.push(state.params, 1)
  assert weights.version == 1
  _check_sampler_weights(weights.latest()[0], state.params, dtype, sampler_devs)
  sampler.update_weights(state.params, 2)  # trainer-mesh leaves in param_dtype: cast on the sampler mesh
  assert sampler.version == 2
  _check_sampler_weights(sampler.weights.latest()[0], state.params, dtype, sampler_devs)
