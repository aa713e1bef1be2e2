"""Hugging Face checkpoints (config.json + safetensors) ⇄ rlax parameter trees.

Loading never holds the model on one device or on the host: every parameter is
built with `jax.make_array_from_callback`, and each device's callback reads only
its own slice of the safetensors files (per layer, through `get_slice`). Saving
gathers one layer of one tensor at a time. HF linear weights are [out, in]; the
rlax tree keeps [in, ..., out] with heads split out, stacked over layers:
q_proj [H*Dh, D] → q[l] [D, H, Dh]; o_proj [D, H*Dh] → o[l] [H, Dh, D].
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import math
import os
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from rlax.models import sharding, transformer
from rlax.models.config import ModelConfig, checkpoint_fields
from rlax.models.hf_config import config_from_hf, config_to_hf
from rlax.models.hf_tokenizer import Tokenizer, load_tokenizer
from rlax.models.init import param_shardings

__all__ = ["config_from_hf", "config_to_hf", "load_checkpoint", "save_checkpoint", "load_tokenizer",
           "Tokenizer"]

_INDEX = "model.safetensors.index.json"
# Buffers some exporters write that carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class _Layout:
  """How one HF tensor maps to one rlax (per-layer) array.

  The HF tensor, reshaped to `split` (each HF dim is `groups[i]` consecutive
  split dims), transposed by `perm`, is the rlax array.
  """
  name: str  # with "{i}" for the layer index when stacked, and "{e}" for the expert index
  split: tuple[int, ...]
  groups: tuple[int, ...]
  perm: tuple[int, ...]

  @property
  def hf_shape(self) -> tuple[int, ...]:
    out, pos = [], 0
    for g in self.groups:
      out.append(math.prod(self.split[pos:pos + g]))
      pos += g
    return tuple(out)

  def to_rlax(self, read: Callable[[tuple[slice, ...]], np.ndarray], idx: tuple[slice, ...]) -> np.ndarray:
    """Reads the block `idx` (slices over rlax dims) through `read(hf_slices)`."""
    bounds = [None] * len(self.split)
    for j, s in enumerate(idx):
      start, stop, step = s.indices(self.split[self.perm[j]])
      if step != 1:
        raise ValueError(f"strided shard index {s} for {self.name}")
      bounds[self.perm[j]] = (start, stop)
    hf_sl, local, post, pos = [], [], [], 0
    for g in self.groups:
      # Read a contiguous run of the outermost split dim; inner dims are cut after the reshape.
      inner = math.prod(self.split[pos + 1:pos + g])
      a, b = bounds[pos]
      hf_sl.append(slice(a * inner, b * inner))
      local += [b - a, *self.split[pos + 1:pos + g]]
      post += [slice(None)] + [slice(*bounds[d]) for d in range(pos + 1, pos + g)]
      pos += g
    x = np.asarray(read(tuple(hf_sl))).reshape(local)[tuple(post)]
    return x.transpose(self.perm)

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.transpose(np.argsort(self.perm)).reshape(self.hf_shape))


def _layouts(cfg: ModelConfig) -> dict[str, Any]:
  """The rlax parameter tree with a _Layout at every leaf."""
  D, H, K, Dh, F, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
  p = "model.layers.{i}."
  vec = lambda name, n: _Layout(name, (n,), (1,), (0,))
  layers = {
      "attn_norm": vec(p + "input_layernorm.weight", D),
      "q": _Layout(p + "self_attn.q_proj.weight", (H, Dh, D), (2, 1), (2, 0, 1)),
      "k": _Layout(p + "self_attn.k_proj.weight", (K, Dh, D), (2, 1), (2, 0, 1)),
      "v": _Layout(p + "self_attn.v_proj.weight", (K, Dh, D), (2, 1), (2, 0, 1)),
      "o": _Layout(p + "self_attn.o_proj.weight", (D, H, Dh), (1, 2), (1, 2, 0)),
      "mlp_norm": vec(p + "post_attention_layernorm.weight", D),
      "gate": _Layout(p + "mlp.gate_proj.weight", (F, D), (1, 1), (1, 0)),
      "up": _Layout(p + "mlp.up_proj.weight", (F, D), (1, 1), (1, 0)),
      "down": _Layout(p + "mlp.down_proj.weight", (D, F), (1, 1), (1, 0)),
  }
  m = cfg.moe
  if m is not None:
    for n in ("gate", "up", "down"):
      del layers[n]
    Fe, mix = m.expert_mlp_dim, cfg.arch == "mixtral"
    mp = p + ("block_sparse_moe." if mix else "mlp.")
    ex = lambda n, hf_n: mp + "experts.{e}." + (f"{hf_n}.weight" if mix else f"{n}_proj.weight")
    layers.update(router=_Layout(mp + "gate.weight", (m.n_experts, D), (1, 1), (1, 0)),
                  experts_gate=_Layout(ex("gate", "w1"), (Fe, D), (1, 1), (1, 0)),
                  experts_up=_Layout(ex("up", "w3"), (Fe, D), (1, 1), (1, 0)),
                  experts_down=_Layout(ex("down", "w2"), (D, Fe), (1, 1), (1, 0)))
    if m.shared_mlp_dim:
      Fs = m.shared_mlp_dim
      layers.update(shared_gate=_Layout(p + "mlp.shared_expert.gate_proj.weight", (Fs, D), (1, 1), (1, 0)),
                    shared_up=_Layout(p + "mlp.shared_expert.up_proj.weight", (Fs, D), (1, 1), (1, 0)),
                    shared_down=_Layout(p + "mlp.shared_expert.down_proj.weight", (D, Fs), (1, 1), (1, 0)),
                    shared_router=_Layout(p + "mlp.shared_expert_gate.weight", (1, D), (1, 1), (1, 0)))
  if cfg.qkv_bias:
    for n, heads in (("q", H), ("k", K), ("v", K)):
      layers[f"{n}_bias"] = _Layout(p + f"self_attn.{n}_proj.bias", (heads, Dh), (2,), (0, 1))
  if cfg.qk_norm:
    layers["q_norm"] = vec(p + "self_attn.q_norm.weight", Dh)
    layers["k_norm"] = vec(p + "self_attn.k_norm.weight", Dh)
  tree = {"embed": _Layout("model.embed_tokens.weight", (V, D), (1, 1), (0, 1)), "layers": layers,
          "final_norm": vec("model.norm.weight", D)}
  if not cfg.tie_embeddings:
    tree["lm_head"] = _Layout("lm_head.weight", (V, D), (1, 1), (1, 0))
  return tree


def _is_layout(x) -> bool:
  return isinstance(x, _Layout)


def _n_experts(cfg: ModelConfig, lay: _Layout) -> int:
  """How many experts `lay` stacks (its rlax array's axis after the layers), 0 when it is not per expert."""
  return cfg.moe.n_experts if "{e}" in lay.name else 0


def _expected(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Every HF tensor name the checkpoint must hold → its HF shape."""
  out = {}
  for path, lay in jax.tree.flatten_with_path(_layouts(cfg), is_leaf=_is_layout)[0]:
    stacked = path[0].key == "layers"
    for i in range(cfg.n_layers if stacked else 1):
      for e in range(_n_experts(cfg, lay) or 1):
        out[lay.name.format(i=i, e=e)] = lay.hf_shape
  return out


def _read_json(fname: str) -> dict[str, Any]:
  """The JSON object in `fname`; a file that is not one raises one ValueError naming it."""
  try:
    with open(fname, encoding="utf-8") as f:
      d = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{fname}: not valid JSON ({e})") from None
  if not isinstance(d, dict):
    raise ValueError(f"{fname}: expected a JSON object, got {type(d).__name__}")
  return d


def _safe_open(fname: str):
  """`safe_open(fname)`, with a truncated or corrupt file named in the error."""
  try:
    return safe_open(fname, framework="numpy")
  except Exception as e:  # safetensors raises its own SafetensorError (not exported) or OSError
    raise ValueError(f"{fname}: not a readable safetensors file ({e})") from None


def _tensor_files(path: str) -> dict[str, str]:
  """HF tensor name → safetensors file, from the index json or by scanning the files."""
  index = os.path.join(path, _INDEX)
  if os.path.exists(index):
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index}: has no 'weight_map' object")
    for fname in sorted(set(weight_map.values())):
      if not os.path.exists(os.path.join(path, fname)):
        raise ValueError(f"{index} names {fname}, which does not exist")
    return {k: os.path.join(path, v) for k, v in weight_map.items()}
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"no *.safetensors files in {path}")
  out = {}
  for fname in files:
    with _safe_open(fname) as f:
      for k in f.keys():
        if k in out:
          raise ValueError(f"tensor {k!r} appears in both {out[k]} and {fname}")
        out[k] = fname
  return out


def read_config(path: str, dtype=None) -> ModelConfig:
  """ModelConfig from `path/config.json` (see `config_from_hf`)."""
  cfg_file = os.path.join(path, "config.json")
  if not os.path.exists(cfg_file):
    raise FileNotFoundError(f"no config.json in {path}")
  hf = _read_json(cfg_file)
  dtype = None if dtype is None else jnp.dtype(dtype).name
  try:
    return config_from_hf(hf, dtype=dtype)
  except (ValueError, TypeError) as e:  # a field of the wrong type or value
    raise ValueError(f"{cfg_file}: {e}") from None


def load_checkpoint(path: str, mesh: Optional[Mesh] = None, dtype=None, rules=sharding.RULES,
                    cfg: Optional[ModelConfig] = None) -> tuple[ModelConfig, transformer.Params]:
  """(cfg, params) from an HF checkpoint directory, each array placed straight into its sharding.

  `path` holds config.json and model.safetensors (or shards + model.safetensors.index.json).
  With `mesh`, parameters get `param_shardings(cfg, mesh, rules)`; without, the
  first local device. `dtype` overrides the checkpoint dtype for params and compute.
  `cfg` replaces the config read from config.json (e.g. other dtypes or remat); its
  architecture and shapes must be the checkpoint's.
  A missing, misshapen or unexpected tensor raises one ValueError naming it.
  """
  own = read_config(path, dtype)
  if cfg is not None:
    want, have = checkpoint_fields(cfg), checkpoint_fields(own)
    differ = [name for name in want if want[name] != have[name]]
    if differ:
      raise ValueError(f"checkpoint {path}: model config differs from config.json in {differ[0]} "
                       f"({want[differ[0]]!r} vs {have[differ[0]]!r})")
  else:
    cfg = own
  files = _tensor_files(path)
  expected = _expected(cfg)
  with contextlib.ExitStack() as stack:
    handles = {f: stack.enter_context(_safe_open(f)) for f in sorted(set(files.values()))}
    problems = []
    for name, shape in expected.items():
      if name not in files:
        problems.append(f"missing tensor {name!r} (expected shape {shape})")
        continue
      actual = tuple(handles[files[name]].get_slice(name).get_shape())
      if actual != shape:
        problems.append(f"tensor {name!r} has shape {actual}, expected {shape}")
    ignored = ("lm_head.weight",) if cfg.tie_embeddings else ()  # tied: transformers ignores it too
    for name in sorted(set(files) - set(expected)):
      if not name.endswith(_IGNORED_SUFFIXES) and name not in ignored:
        problems.append(f"unexpected tensor {name!r} for {cfg.arch} config")
    if problems:
      more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
      raise ValueError(f"checkpoint {path}: {problems[0]}{more}")

    shapes = transformer.param_shapes(cfg)
    if mesh is None:
      one = SingleDeviceSharding(jax.local_devices()[0])
      shards = jax.tree.map(lambda _: one, shapes, is_leaf=lambda s: isinstance(s, tuple))
    else:
      shards = param_shardings(cfg, mesh, rules)
    np_dtype = cfg.jnp_param_dtype

    def build(kp, lay: _Layout):
      stacked = kp[0].key == "layers"
      leaf, shard = shapes, shards
      for k in kp:
        leaf, shard = leaf[k.key], shard[k.key]

      n_experts = _n_experts(cfg, lay)

      def read_one(i, e, idx):
        name = lay.name.format(i=i, e=e)
        sl = handles[files[name]].get_slice(name)
        return lay.to_rlax(lambda hf_idx: sl[hf_idx], idx)

      def read_layer(i, idx):
        if not n_experts:
          return read_one(i, 0, idx)
        return np.stack([read_one(i, e, idx[1:]) for e in range(*idx[0].indices(n_experts))])

      def callback(index):
        if not stacked:
          return read_layer(0, tuple(index)).astype(np_dtype)
        layers = range(*index[0].indices(cfg.n_layers))
        return np.stack([read_layer(i, tuple(index[1:])) for i in layers]).astype(np_dtype)

      return jax.make_array_from_callback(tuple(leaf), shard, callback)

    params = jax.tree.map_with_path(build, _layouts(cfg), is_leaf=_is_layout)
  return cfg, params


@jax.jit
def _layer_slice(x, i):
  return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


@jax.jit
def _expert_slice(x, i, e):
  """x[i, e] of a [layers, experts, ...] array, without a copy of the layer's other experts."""
  return jax.lax.dynamic_slice(x, (i, e) + (0,) * (x.ndim - 2), (1, 1) + x.shape[2:])[0, 0]


def save_checkpoint(params: transformer.Params, cfg: ModelConfig, path: str, *,
                    max_shard_bytes: int = 5 * 2**30, extra_config: Optional[dict] = None) -> list[str]:
  """Writes an HF checkpoint (config.json + safetensors) that transformers loads.

  Tensors are saved in `cfg.param_dtype`, in files of at most `max_shard_bytes`
  (plus model.safetensors.index.json when more than one). Each tensor is
  gathered to the host one layer at a time (call it outside another mesh's
  `jax.set_mesh`). `extra_config` is merged into config.json (e.g. bos/eos
  token ids). Returns the written file names.
  """
  hf_cfg = {**config_to_hf(cfg), **(extra_config or {})}
  want = transformer.param_shapes(cfg)
  for kp, shape in jax.tree.flatten_with_path(want, is_leaf=lambda s: isinstance(s, tuple))[0]:
    leaf = params
    for k in kp:
      if not isinstance(leaf, dict) or k.key not in leaf:
        raise ValueError(f"params lack {jax.tree_util.keystr(kp)} (expected shape {shape})")
      leaf = leaf[k.key]
    if tuple(leaf.shape) != shape:
      raise ValueError(f"params{jax.tree_util.keystr(kp)} has shape {tuple(leaf.shape)}, expected {shape}")
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      raise ValueError(f"params{jax.tree_util.keystr(kp)} spans several processes; save from one host's copy")
  dtype = cfg.jnp_param_dtype
  # (hf name, rlax leaf, layer or None, layout) in HF order: embed, layer by layer, norm, lm_head.
  lays = _layouts(cfg)
  entries = [("model.embed_tokens.weight", params["embed"], None, lays["embed"])]
  for i in range(cfg.n_layers):
    for k, lay in lays["layers"].items():
      for e in range(_n_experts(cfg, lay)) if _n_experts(cfg, lay) else (None,):
        entries.append((lay.name.format(i=i, e=e), params["layers"][k], i if e is None else (i, e), lay))
  entries.append(("model.norm.weight", params["final_norm"], None, lays["final_norm"]))
  if not cfg.tie_embeddings:
    entries.append(("lm_head.weight", params["lm_head"], None, lays["lm_head"]))

  shards, size = [[]], 0
  for e in entries:
    n = math.prod(e[3].hf_shape) * dtype.itemsize
    if shards[-1] and size + n > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(e)
    size += n
  os.makedirs(path, exist_ok=True)
  # Stale files from an earlier save would shadow or contradict the new index.
  for pattern in ("model.safetensors", "model-*-of-*.safetensors", _INDEX):
    for old in glob.glob(os.path.join(path, pattern)):
      os.remove(old)
  names = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors" for j in range(len(shards))])
  weight_map, total = {}, 0
  for fname, shard in zip(names, shards):
    tensors = {}
    for name, leaf, layer, lay in shard:
      x = leaf if layer is None else (_layer_slice(leaf, layer) if isinstance(layer, int) else
                                      _expert_slice(leaf, *layer))
      tensors[name] = lay.to_hf(np.asarray(jax.device_get(x)).astype(dtype))
      weight_map[name] = fname
      total += tensors[name].nbytes
    save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
  if len(shards) > 1:
    with open(os.path.join(path, _INDEX), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_cfg, f, indent=2)
  return names + ([_INDEX] if len(shards) > 1 else []) + ["config.json"]
