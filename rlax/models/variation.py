"""What the train state's params are, decided once per run: the model's own weights (full fine-tuning) or
low-rank adapters over a frozen base (rlax.models.lora). How they are trained, which reference they imply, how
they become plain weights and what they cost is written here once; the trainer, the run's start and recovery,
the checkpoint reader and the memory estimate ask this object instead of branching on `model.lora`.

    v = variation.of(model_cfg, lora_cfg, seed=run.seed)
    trained = v.init(params)               # what the optimizer updates (params, or fresh adapters)
    v.forward(trained, base)               # what a forward pass differentiates
    v.merge(trained, base)                 # plain weights: export, evaluation
"""

from __future__ import annotations

from typing import Any, Optional

import jax
from jax.sharding import Mesh

from rlax.models import lora as lora_lib
from rlax.models.config import ModelConfig
from rlax.models.init import abstract_params, param_shardings


class FullWeights:
  """Every weight trains: the state's params are the model's, there is no frozen base."""
  frozen_base = False  # whether a forward needs the frozen base weights beside the trained tree

  def __init__(self, cfg: ModelConfig):
    self.cfg = cfg

  def abstract(self) -> Any:
    """ShapeDtypeStructs of the trained tree."""
    return abstract_params(self.cfg)

  def shardings(self, mesh: Mesh) -> Any:
    """The trained tree's shardings on `mesh`."""
    return param_shardings(self.cfg, mesh)

  def init(self, params: Any) -> Any:
    """The trained tree a run starts from, given the model's starting weights (traced inside the init jit)."""
    return params

  def forward(self, trained: Any, base: Any) -> Any:
    """The params a forward pass uses."""
    return trained

  def merge(self, trained: Any, base: Any) -> Any:
    """The policy as plain model weights."""
    return trained

  def step_args(self, base: Any) -> tuple:
    """The train steps' arguments after (state, batch): the frozen base where there is one."""
    return ()

  def reference(self, trained: Any, base: Any) -> Any:
    """The KL reference policy at the start of RL: a copy of the trained weights (the step donates them)."""
    return jax.tree.map(lambda x: x.copy(), trained)

  def describe(self) -> str:
    return "every weight trains"

  # Passes over the weights one train step makes besides the forward: the backward's input and weight gradients.
  backward_passes = 2

  def pushed(self, weights: Any, mesh: Mesh) -> Any:
    """ShapeDtypeStructs of what one push delivers to a sampler on `mesh` whose weights are `weights`: those
    weights, in the sampler's compute dtype."""
    return weights

  def push_dtype(self, compute_dtype: Any) -> Any:
    """The dtype a push casts to (None: as trained)."""
    return compute_dtype


class Adapters(FullWeights):
  """Low-rank adapters train (seeded by `seed`, B = 0 so step 0 is the base model); the base stays frozen, is
  the KL reference, and the adapters merge into it for plain weights."""
  frozen_base = True

  def __init__(self, cfg: ModelConfig, lora: lora_lib.LoraConfig, seed: int = 0):
    super().__init__(cfg)
    self.lora, self.seed = lora, seed

  def abstract(self) -> Any:
    return lora_lib.abstract(self.cfg, self.lora)

  def shardings(self, mesh: Mesh) -> Any:
    return lora_lib.adapter_shardings(self.cfg, self.lora, mesh)

  def init(self, params: Any) -> Any:
    return lora_lib.init(self.cfg, self.lora, jax.random.key(self.seed))

  def forward(self, trained: Any, base: Any) -> Any:
    return lora_lib.attach(base, trained, self.lora)

  def merge(self, trained: Any, base: Any) -> Any:
    return lora_lib.merge(base, trained, self.lora)

  def step_args(self, base: Any) -> tuple:
    if base is None:
      raise ValueError("a LoRA trainer needs its base weights: init_state(params) or set_base(params) first")
    return (base,)

  def reference(self, trained: Any, base: Any) -> Any:
    return base  # frozen: no copy

  def describe(self) -> str:
    return f"rank-{self.lora.rank} adapters over a frozen base"

  backward_passes = 1  # no weight gradients of the frozen base

  def pushed(self, weights: Any, mesh: Mesh) -> Any:
    """The adapters (f32, on the sampler's adapter shardings): the sampler merges them into its own copy of
    the base, which crosses once."""
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), self.abstract(),
                        self.shardings(mesh))

  def push_dtype(self, compute_dtype: Any) -> Any:
    return None


def of(cfg: ModelConfig, lora: Optional[lora_lib.LoraConfig] = None, seed: int = 0) -> FullWeights:
  """The variation `lora` names (rank 0 or None: full fine-tuning)."""
  lora = (lora or lora_lib.LoraConfig()).validate()
  return Adapters(cfg, lora, seed) if lora.enabled else FullWeights(cfg)
