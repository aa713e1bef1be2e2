"""Typed run config + topology → the run's parts. Every part of the runtime is built here, once.

`components(run, topology)` builds what this process holds: the trainer where it owns the trainer mesh,
the sampler where it owns the sampler mesh (one process, or Pathways: both), and the weights service over
the transport that connects them. Failover rebuilds through the same function.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any, Optional, Sequence

from absl import logging
import jax
import numpy as np

from rlax import models
from rlax import envs
from rlax import judges
from rlax import rewards
from rlax import run as run_lib
from rlax import teachers
from rlax.algorithms import AlgorithmConfig
from rlax.config import RunConfig
from rlax.data import synthetic
from rlax.data import tokenizer as tok_lib
from rlax.data.pipeline import RecordIterator
from rlax.data.prompts import PromptRenderer
from rlax.data.records import Record, read_records
from rlax.envs import journal
from rlax.envs import retrieval
from rlax.models import hf
from rlax.models.hf_tokenizer import Tokenizer
from rlax.multihost import Channel, local_roles
from rlax.rollout import text as rollout_text
from rlax.sampler import Sampler
from rlax.sampler import sizing
from rlax.sampler.layouts import make_layout
from rlax.sampler import strategies
from rlax.sampler.strategies import SamplingMethod
from rlax.topology import Topology
from rlax.trainer import OptimizerConfig, Trainer
from rlax.models import variation
from rlax.weights import AdapterTransport, CrossProcessTransport, DevicePutTransport, WeightsService


# -- data and rewards --------------------------------------------------------------------------------------
def tokenizer(run: RunConfig) -> Tokenizer:
  """The HF directory's tokenizer (special tokens, chat template, stop tokens), else the demo's."""
  return hf.load_tokenizer(run.hf_checkpoint) if run.hf_checkpoint else tok_lib.demo_tokenizer()


def checked_tokenizer(run: RunConfig, tok: Optional[Tokenizer] = None) -> Tokenizer:
  """`tok` (default: the run's), after checking that the model embeds every token id."""
  tok = tok or tokenizer(run)
  if tok.vocab_size > run.model.vocab_size:
    raise ValueError(f"tokenizer has {tok.vocab_size} tokens but model.vocab_size is {run.model.vocab_size}")
  return tok


def workdir(run: RunConfig) -> str:
  """The run's directory, created where it is not there yet."""
  try:
    os.makedirs(run.workdir, exist_ok=True)
  except OSError as e:  # a read-only filesystem, or a race with the check in config.validate
    raise ValueError(f"workdir={run.workdir!r}: {e.strerror}") from None
  return run.workdir


def renderer(run: RunConfig, tok: Tokenizer) -> PromptRenderer:
  d = run.data
  return PromptRenderer(tok, template=d.template, system_prompt=d.system_prompt, instruction=d.instruction)


def _shape_records(records: list[Record], run: RunConfig) -> list[Record]:
  d = run.data
  if d.ops:
    if d.task != "arithmetic":
      raise ValueError(f"data.ops={d.ops!r} applies to task 'arithmetic' only, not {d.task!r}")
    records = [r for r in records if all(ch in d.ops for ch in r.metadata["expression"] if ch in "+-*/")]
  if d.prompt_style == "compact":
    if any("compact" not in r.metadata for r in records[:1]):
      raise ValueError(f"data.prompt_style='compact': task {d.task!r} has no compact prompt form")
    records = [dataclasses.replace(r, prompt=r.metadata["compact"]) for r in records]
  return records


def _hold_out(candidates, n: int) -> tuple[list[Record], set]:
  held, seen = [], set()
  for r in candidates:
    if r.prompt not in seen and len(held) < n:
      held.append(r)
      seen.add(r.prompt)
  return held, seen


def read_files(run: RunConfig, paths) -> list[Record]:
  """The records of `paths` (columns as the data section maps them); a record without the reference the run's
  reward grades against (rewards.missing_reference) is one error naming it. Callers: `datasets`,
  rlax.evaluation."""
  out = []
  for path in paths:
    for r in read_records(path, run.data.columns()):
      missing = rewards.missing_reference(run.reward.name, r)
      if missing:
        where = r.id if r.id.startswith(f"{path}:") else f"{path}: record {r.id!r}"  # an id defaults to file:line
        raise ValueError(f"{where}: no `{missing}`, which reward.name={run.reward.name!r} grades against "
                         "(reward.name=judge or a user's reward needs none)")
      out.append(r)
  return out


def datasets(run: RunConfig) -> tuple[list[Record], list[Record]]:
  """Train and held-out eval records: the configured synthetic task, or the user's files.

  The eval set (n_eval distinct prompts: drawn with data.eval_seed, or the first of data.eval_files, or
  held out of the training files with data.eval_seed) comes first; every training record with an eval
  prompt is removed, so pass@k is measured on problems the policy never trained on.
  """
  d = run.data
  if d.files("train"):
    train = read_files(run, d.files("train"))
    if d.files("eval"):
      held, seen = _hold_out(read_files(run, d.files("eval")), d.n_eval)
    else:
      order = np.random.default_rng(d.eval_seed).permutation(len(train))
      held, seen = _hold_out([train[i] for i in order], d.n_eval)
    train = [r for r in train if r.prompt not in seen]
  else:
    gen = lambda n, seed, split: _shape_records(synthetic.generate(d.task, n, difficulty=d.difficulty, seed=seed,
                                                                   options=d.task_options, split=split), run)
    held, seen = _hold_out(gen(d.n_eval * 8, d.eval_seed, "eval"), d.n_eval)
    train = [r for r in gen(d.n_train, run.seed, "train") if r.prompt not in seen]
  if not train or not held:
    raise ValueError(f"data: {len(train)} train / {len(held)} held-out records after filtering; "
                     "widen data.ops, raise data.n_train or data.difficulty, or add records")
  return train, held


def train_and_eval_records(run: RunConfig, render: PromptRenderer,
                           records: Optional[tuple[list[Record], list[Record]]] = None
                           ) -> tuple[list[Record], list[Record], dict]:
  """(train, eval, {"train": dropped, "eval": dropped}): `records` (train, eval), else the run's datasets, less
  the prompts longer than rollout.max_prompt_len (the sampler cannot generate from them)."""
  train, held = records or datasets(run)
  limit = run.rollout.max_prompt_len
  kept, dropped = render.fitting(train, limit)
  kept_eval, dropped_eval = render.fitting(held, limit)
  if (dropped or dropped_eval) and records is None and not run.data.train_files:
    # A built-in task's prompts come from one generator: dropping the longer ones would skew the task.
    longest = max(len(render.encode(r)) for r in [*train, *held])
    raise ValueError(f"rollout.max_prompt_len={limit} is shorter than {dropped + dropped_eval} of task "
                     f"{run.data.task!r}'s prompts (the longest has {longest} tokens); raise it to {longest}")
  if dropped or dropped_eval:
    logging.warning("dropped %d train and %d eval prompts longer than rollout.max_prompt_len=%d tokens",
                    dropped, dropped_eval, limit)
  if not kept or not kept_eval:
    raise ValueError(f"every {'training' if not kept else 'eval'} prompt is longer than "
                     f"rollout.max_prompt_len={limit} tokens; raise it")
  return kept, kept_eval, {"train": dropped, "eval": dropped_eval}


def record_iterator(run: RunConfig, records: list[Record]) -> RecordIterator:
  return RecordIterator(records, seed=run.seed)


def reward_fn(run: RunConfig):
  """The run's reward entry; reward.name="judge": a `judges.JudgeReward`, graded once its judge is loaded beside
  the sampler (`judge`)."""
  r = run.reward
  if r.name == "judge":
    return judges.JudgeReward()
  return rewards.build(r.name, answer=r.answer, format_weight=r.format_weight)


def episodes(run: RunConfig, tok: Tokenizer, render: PromptRenderer, reward, pool):
  """`episodes(stream, sync, keys) -> EpisodeStream` over the configured environment (env.name "": one-turn
  episodes, rlax.envs.single_turn_episodes): one environment per episode, built by the registry's factory with
  the run's tokenizer, renderer, reward and verifier pool. keys=True (training): tool calls are journaled in
  <workdir>/tool_journal.jsonl, so a resumed run replays the calls the killed one had finished. `make.close()`
  stops the run's retrieval service."""
  e = run.env
  if not e.episodic:
    return envs.single_turn_episodes(render, reward, pool.grade)
  factory = envs.get(e.name)
  ctx = envs.EnvContext(tokenizer=tok, render=render, reward_fn=reward, grade=pool.grade, pool=pool, config=e,
                        journal=envs.ToolJournal(os.path.join(run.workdir, journal.FILE)),
                        retrieval=retrieval.service(e))

  def make(stream, sync: bool = False, keys: bool = False) -> envs.EpisodeStream:
    return envs.EpisodeStream(stream, lambda: factory(ctx), context_tokens=e.context_tokens,
                              turn_tokens=e.turn_tokens, sync=sync, keys=keys)

  def check_prompts(records: Sequence[Record]) -> None:
    """One ValueError naming the first record whose environment prompt is longer than rollout.max_prompt_len:
    checked before anything compiles (the episode stream would find it mid-run)."""
    async def first_prompts():
      return [len((await factory(ctx).reset(r)).tokens) for r in records]
    for r, n in zip(records, asyncio.run(first_prompts())):
      if n > run.rollout.max_prompt_len:
        raise ValueError(f"env {e.name!r}: the first prompt of record {r.id!r} has {n} tokens; "
                         f"rollout.max_prompt_len is {run.rollout.max_prompt_len}")

  make.close = ctx.retrieval.close if ctx.retrieval is not None else (lambda: None)  # Sampling.close calls it
  make.check_prompts = check_prompts  # SamplerRole calls it
  return make


def verifier_pool(run: RunConfig) -> rewards.VerifierPool:
  """The run's grading processes; a run that grades code with no jail here stops at once, in one line, unless
  it opted in with reward.sandbox=unsafe (never a silent fallback, nor a run of zero rewards)."""
  r = run.reward
  grades_code = "code" in r.name or ("auto" in r.name and any(t in run.data.task for t in ("program", "code")))
  if grades_code and r.sandbox == "auto":
    try:
      rewards.isolation_mode()
    except RuntimeError as e:  # launch.main prints it as one line
      raise ValueError(f"reward.sandbox=auto: {e}") from None
  return rewards.VerifierPool(num_workers=r.workers, timeout_s=r.timeout_s, memory_mb=r.memory_mb,
                              max_chars=r.max_chars, sandbox=r.sandbox)


# -- models ------------------------------------------------------------------------------------------------
def weights_dtype(run: RunConfig):
  """The sampler holds its weights in the compute dtype; the push casts on the trainer side (fewer bytes)."""
  return run.model.jnp_dtype


def trainer(run: RunConfig, mesh) -> Trainer:
  """The RL trainer on `mesh`, with the run's batch shapes fixed (rlax.run.train_plan; `compile_ahead` compiles
  them)."""
  o, r = run.optimizer, run.rollout
  tr = Trainer(run.model, run.algorithm, o.optimizer(run.controller.steps), mesh, group_size=r.samples_per_prompt,
               micro_batches=o.micro_batches, micro_batch_tokens=o.micro_batch_tokens, temperature=r.temperature,
               lora=run.lora, lora_seed=run.seed)
  tr.fix_shapes(run_lib.train_plan(run, tr).abstract(tr, with_ref=run.algorithm.kl_coef > 0))
  return tr


def sft_trainer(run: RunConfig, mesh) -> Trainer:
  # The warm start trains only the policy: no RL objective, so no value model (PPO's critic) is built.
  return Trainer(run.model, AlgorithmConfig(), OptimizerConfig(lr=run.init.sft_lr, warmup_steps=10), mesh,
                 group_size=1)


def slots(run: RunConfig, mesh, budget: Optional[int] = None, platform: Optional[str] = None) -> int:
  """The sampler's decode slots: rollout.slots, the batch's rows in whole groups (0), or with -1 as many as the
  per-device budget holds (default: the free memory of the sampler's first device), up to this batch and the
  next one's prompts in flight. The memory estimate sizes them by the same call; platform: the devices' (default:
  the mesh's, else the default backend's), which picks the cache layout."""
  r = run.rollout
  n = r.decode_slots(run.eval.n_samples)
  if r.slots != -1:
    return n
  device = mesh.devices.flat[0] if isinstance(mesh, jax.sharding.Mesh) else jax.devices()[0]
  lay = make_layout(run.model, "auto", r.max_prompt_len, r.max_new_tokens, platform=platform or device.platform)
  unit = sizing.row_unit(mesh, r.samples_per_prompt, run.eval.n_samples, n)
  if budget is None:
    budget = sizing.device_budget(device, free=True)
  return sizing.slots_that_fit(run.model, lay, r.max_prompt_len + r.max_new_tokens, unit=unit,
                               cap=r.rows + r.ahead * r.samples_per_prompt, budget=budget, mesh=mesh)


def sampler(run: RunConfig, mesh, tok: Tokenizer) -> Sampler:
  """The sampling engine on `mesh` (its streams read the run's weights service); stops on every eos token of
  the tokenizer (chat models end a turn with several)."""
  r = run.rollout
  return Sampler(run.model, mesh, max_prompt_len=r.max_prompt_len, max_new_tokens=r.max_new_tokens,
                 slots=slots(run, mesh), eos_id=tok.eos_ids, pad_id=tok.pad_id, decode_chunk=r.decode_chunk,
                 on_swap=r.on_swap)


def teacher(run: RunConfig, mesh, tok: Tokenizer):
  """A distilling run's teachers (rlax.teachers.Teachers: one, or one per route) on `mesh` in the policy's compute
  dtype, each tokenizer checked against the policy's; None for any other run."""
  if not run.algorithm.distills:
    return None
  load = lambda path: teachers.Teacher.load(dataclasses.replace(run.teacher, hf_checkpoint=path), mesh=mesh,
                                            student_tokenizer=tok, student_vocab=run.model.vocab_size,
                                            dtype=run.model.dtype, top_k=run.algorithm.teacher_top_k)
  return teachers.Teachers({name: load(path) for name, path in run.teacher.dirs().items()},
                           field=run.teacher.route_field, pass_rows=run.teacher.rows_per_pass)


def judge_slots(run: RunConfig) -> int:
  """Replies the judge decodes at once: judge.slots, else one step's rollouts. Callers: `judge`, rlax.memory."""
  return run.judge.slots or run.rollout.rows


def judge(run: RunConfig, mesh):
  """A judging run's judge (rlax.judges) on `mesh` in the policy's compute dtype, its sample log in the run's
  logs; None for any other run."""
  if run.reward.name != "judge":
    return None
  logs = os.path.join(run.workdir, "logs")
  os.makedirs(logs, exist_ok=True)
  return judges.Judge.load(run.judge, mesh=mesh, slots=judge_slots(run), dtype=run.model.dtype,
                           log_path=os.path.join(logs, "judge.jsonl"))


def sampling_method(run: RunConfig) -> SamplingMethod:
  r = run.rollout
  return rollout_text.strategy(r.temperature, r.top_k, r.top_p)


def eval_method(run: RunConfig) -> SamplingMethod:
  return rollout_text.strategy(run.eval.temperature)


def sampler_uses(run: RunConfig) -> tuple[tuple[int, SamplingMethod], ...]:
  """(samples per group, strategy) of every way the run samples: rollouts, evaluation, greedy evaluation
  (what `Sampler.warm_up` compiles ahead)."""
  uses = [(run.rollout.samples_per_prompt, sampling_method(run)), (run.eval.n_samples, eval_method(run))]
  if run.eval.greedy:
    uses.append((1, strategies.Greedy()))
  return tuple(dict.fromkeys(uses))


# -- the parts a process holds -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Components:
  """What this process holds: trainer and/or sampler (None where another process holds it) and weights;
  the tokenizer the sampler stops with."""
  topology: Topology
  trainer: Optional[Trainer]
  sampler: Optional[Sampler]
  weights: WeightsService
  tokenizer: Tokenizer


def weights_service(run: RunConfig, topology: Topology, channel: Optional[Channel] = None,
                    history_from: Optional[WeightsService] = None, trainer: Optional[Trainer] = None
                    ) -> WeightsService:
  """The weights service between `topology`'s submeshes over the transport the process layout needs.

  Deterministic runs with scheduled slice faults keep trainer-side copies of the last k pushes, so a rebuilt
  sampler can regenerate a batch with exactly its version; `history_from`: the service they are taken over from.
  """
  shardings = models.param_shardings(run.model, topology.sampler_mesh)
  has_trainer, has_sampler = local_roles(topology.trainer_mesh, topology.sampler_mesh)
  kind = variation.of(run.model, run.lora)
  if kind.frozen_base:  # what trains crosses; the sampler merges it into its pristine base (sent once)
    if not (has_trainer and has_sampler) or trainer is None:
      raise ValueError("model.lora with the trainer and sampler in different processes is not supported yet")
    adapters = DevicePutTransport(kind.shardings(topology.sampler_mesh), kind.push_dtype(weights_dtype(run)))
    # The pristine copy is held in the compute dtype: on a bf16 sampler it costs what the merged weights cost.
    transport = AdapterTransport(adapters, DevicePutTransport(shardings, weights_dtype(run)), lambda: trainer.base,
                                 run.lora, weights_dtype(run))
  elif has_trainer and has_sampler:
    transport = DevicePutTransport(shardings, weights_dtype(run))
  else:
    if channel is None:
      raise ValueError("the trainer and sampler live in different processes: a Channel is needed")
    shapes = models.init.abstract_params(run.model)
    transport = CrossProcessTransport(topology.trainer_mesh, topology.sampler_mesh, shardings, weights_dtype(run),
                                      shapes, channel)
  service = WeightsService(transport, keep=run_lib.versions_kept(run), history=run_lib.versions_replayable(run))
  if history_from is not None:
    service.adopt_history(history_from)
  return service


def components(run: RunConfig, topology: Topology, *, tok: Optional[Tokenizer] = None,
               channel: Optional[Channel] = None, reuse: Optional[Components] = None) -> Components:
  """Builds this process's parts on `topology`; with `reuse`, parts whose mesh did not change are kept (the
  weights service is always new: a rebuilt run pushes its versions again; the sampler holds no weights).

  `tok`: the tokenizer (default: `reuse`'s, else the run's)."""
  tok = tok or (reuse.tokenizer if reuse is not None else tokenizer(run))
  has_trainer, has_sampler = local_roles(topology.trainer_mesh, topology.sampler_mesh)
  keep = lambda role: reuse is not None and getattr(reuse.topology, f"{role}_mesh") == getattr(topology,
                                                                                               f"{role}_mesh")
  tr = (reuse.trainer if keep("trainer") else trainer(run, topology.trainer_mesh)) if has_trainer else None
  sa = (reuse.sampler if keep("sampler") else sampler(run, topology.sampler_mesh, tok)) if has_sampler else None
  weights = weights_service(run, topology, channel, history_from=reuse.weights if reuse is not None else None,
                            trainer=tr)
  return Components(topology, tr, sa, weights, tok)


def initial_params(run: RunConfig, mesh) -> Any:
  """The policy before RL, straight into its shardings on the trainer mesh: the HF checkpoint's weights
  (each device reads only its slice of the safetensors) or a random init from the seed."""
  if run.hf_checkpoint:
    return hf.load_checkpoint(run.hf_checkpoint, mesh, cfg=run.model)[1]
  return models.create_params(run.model, mesh, seed=run.seed)

