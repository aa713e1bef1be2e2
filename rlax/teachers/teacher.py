"""A teacher: a frozen model that scores rollouts with its log-probs of the sampled tokens.

    teacher = Teacher.load(run.teacher, mesh=mesh, student_tokenizer=tok, top_k=run.algorithm.teacher_top_k)
    batch = batch.replace(**teacher.scores(batch))   # host RolloutBatch -> teacher_logprobs [B, T-1] (+ top-k)

The same loader, sharding rules and forward as the policy (`rlax.models.hf.load_checkpoint`,
`rlax.trainer.layouts`); one compiled program per batch shape. It scores in the rollout path (the producer's
thread; a thread of its own when on devices of its own), so the trainer never waits on it while the queue
holds a batch. With `top_k` it also gives its k most likely tokens at each scored slot and their log-probs
(top-k forward KL), among the ids the student can sample. Only scored slots (`loss_mask`) keep a value:
prompt and appended (environment) tokens get 0, whatever the row holds there.
"""

from __future__ import annotations

import collections
import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from rlax import models
from rlax.models import hf
from rlax.models import sharding as shd
from rlax.rollout import packing
from rlax.sampler import params as sampler_params
from rlax.teachers.config import TeacherConfig
from rlax.trainer import layouts
from rlax.trainer.batch import TEACHER_FIELDS, RolloutBatch


def check_tokenizers(student, teacher_dir: str) -> None:
  """Raises one ValueError when the teacher's tokenizer maps text to other ids than the student's: its
  log-probs would score other tokens."""
  teacher = hf.load_tokenizer(teacher_dir)
  a = student.backend.get_vocab(with_added_tokens=True)
  b = teacher.backend.get_vocab(with_added_tokens=True)
  if a != b:
    diff = sorted(set(a.items()) ^ set(b.items()))[:3]
    raise ValueError(f"teacher.hf_checkpoint={teacher_dir!r}: its tokenizer differs from the policy's ({len(a)} vs "
                     f"{len(b)} tokens; e.g. {diff}); distillation needs the same token ids")


def row_passes(rows: int, rows_per_pass: int, shards: int = 1) -> int:
  """Passes over a batch of `rows` rows: the fewest that divide it with at most `rows_per_pass` rows each, each
  pass's rows still a multiple of the mesh's `shards` row shards where that can be (1 without a limit).
  Callers: Teacher (`_scored`, `lower`), rlax.memory."""
  if not rows_per_pass or rows <= rows_per_pass:
    return 1
  fit = [p for p in range(-(-rows // rows_per_pass), rows + 1) if rows % p == 0]
  return next((p for p in fit if rows // p % shards == 0), fit[0])


class Teacher:
  """Frozen params on `mesh` (None: the default device) and a compiled scoring program per batch shape; `top_k`:
  also its top-k tokens per slot, among the first `vocab` ids (the student's; 0: all)."""

  def __init__(self, cfg: models.ModelConfig, params, mesh=None, *, temperature: float = 1.0, chunk: int = 256,
               rows_per_pass: int = 0, top_k: int = 0, vocab: int = 0):
    self.cfg, self.mesh, self.params = cfg, mesh, params
    self.temperature, self.chunk, self.rows_per_pass = temperature, chunk, rows_per_pass
    self.top_k, self.vocab = top_k, vocab
    self.traces: collections.Counter = collections.Counter()
    self._fn = jax.jit(self._logprobs, static_argnames=("layout", "passes"))

  @classmethod
  def load(cls, config: TeacherConfig, *, mesh=None, student_tokenizer=None, student_vocab: int = 0,
           dtype=None, top_k: int = 0) -> "Teacher":
    """The teacher `config` names, on `mesh`; with `student_tokenizer`, its tokenizer checked against it first;
    its vocabulary must cover every id the student can sample (`student_vocab`, its embedding's rows)."""
    if student_tokenizer is not None:
      check_tokenizers(student_tokenizer, config.hf_checkpoint)
    cfg, params = hf.load_checkpoint(config.hf_checkpoint, mesh=mesh, dtype=dtype)
    if cfg.vocab_size < student_vocab:
      raise ValueError(f"teacher.hf_checkpoint={config.hf_checkpoint!r}: its {cfg.vocab_size} embedding rows do not "
                       f"cover the policy's {student_vocab}: a sampled id would have no teacher log-prob")
    return cls(cfg, params, mesh, temperature=config.temperature, chunk=config.chunk,
               rows_per_pass=config.rows_per_pass, top_k=top_k, vocab=student_vocab)

  @classmethod
  def abstract(cls, config: TeacherConfig, mesh, dtype=None, *, top_k: int = 0, student_vocab: int = 0
               ) -> "Teacher":
    """The teacher `config` names with ShapeDtypeStructs for weights (config.json only): what launch.plan
    lowers."""
    cfg = hf.read_config(config.hf_checkpoint, dtype=dtype)
    return cls(cfg, sampler_params.abstract(cfg, mesh), mesh, temperature=config.temperature, chunk=config.chunk,
               rows_per_pass=config.rows_per_pass, top_k=top_k, vocab=student_vocab)

  def passes(self, rows: int) -> int:
    return row_passes(rows, self.rows_per_pass, shd.row_shards(self.mesh, rows))

  def lower(self, rows: int, prompt_len: int, length: int) -> jax.stages.Lowered:
    """The scoring program of a padded batch: `rows` rows of `length` tokens, the first `prompt_len` prompt."""
    shapes = {"tokens": ((rows, length), np.int32), "input_mask": ((rows, length), np.bool_),
              "loss_mask": ((rows, length - 1), np.float32)}
    x = {k: jax.ShapeDtypeStruct(s, d, sharding=shd.batch_sharding(self.mesh, rows, len(s)))
         for k, (s, d) in shapes.items()}
    with self._ctx():
      return self._fn.lower(self.params, x, layout=layouts.padded(prompt_len, length), passes=self.passes(rows))

  def _ctx(self):
    return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

  def _logprobs(self, params, x: dict, *, layout: layouts.Layout, passes: int) -> dict:
    self.traces["teacher_logprobs"] += 1  # at trace time only
    names = TEACHER_FIELDS if self.top_k else TEACHER_FIELDS[:1]

    def one(x):
      x = dict(x)
      scored = x.pop("loss_mask") > 0
      out = layout.logprobs(params, self.cfg, x, chunk=self.chunk, temperature=self.temperature, top_k=self.top_k,
                            top_vocab=self.vocab)
      out = out if isinstance(out, tuple) else (out,)
      return {n: jnp.where(scored.reshape(*scored.shape, *(1,) * (o.ndim - 2)), o, 0) for n, o in zip(names, out)}

    if passes == 1:
      return one(x)
    # Pass j takes rows j, j + passes, ...: each device's block of rows feeds every pass, so each pass keeps the
    # batch's row sharding and only its activations are live at once.
    split = lambda a: a.reshape(a.shape[0] // passes, passes, *a.shape[1:]).swapaxes(0, 1)
    out = jax.lax.map(one, jax.tree.map(split, x))
    return jax.tree.map(lambda o: o.swapaxes(0, 1).reshape(-1, *o.shape[2:]), out)

  def scores(self, batch: RolloutBatch) -> dict:
    """The teacher's fields of a host RolloutBatch (rlax.trainer.batch.TEACHER_FIELDS, host arrays):
    teacher_logprobs [B, T-1] of its tokens, and with top_k its top-k ids and log-probs [B, T-1, k]; 0 off
    `loss_mask`. Episodes split into rows (forks) are scored in packed rows (`scores_packed`): one fixed shape,
    one more program."""
    return self.scores_packed(batch) if packing.is_split(batch) else self._scored(batch)

  def scores_packed(self, batch: RolloutBatch) -> dict:
    """`scores` of `batch` computed in packed rows, as a batch whose episodes split into rows is: a row of T
    tokens per sequence, each segment attending as the trainer's do."""
    B, T = batch.tokens.shape
    packed = packing.pack_tokens(batch, packing.PackedShape(length=T, rows=B, slots=T - 1), share_prompts=False)
    return {n: packing.unpack_slots(v, packed, batch) for n, v in self._scored(packed).items()}

  def _scored(self, batch) -> dict:
    layout = layouts.of(batch)
    x = {k: np.asarray(v) for k, v in layout.inputs(batch).items()}
    x.pop("routes", None)  # the policy's experts: a teacher routes afresh
    x["loss_mask"] = np.asarray(batch.loss_mask, np.float32)
    if self.mesh is not None:  # rows over the mesh's batch axes, as the trainer's batch
      x = jax.device_put(x, {k: shd.batch_sharding(self.mesh, v.shape[0], v.ndim) for k, v in x.items()})
    with self._ctx():
      out = self._fn(self.params, x, layout=layout, passes=self.passes(x["tokens"].shape[0]))
      return {n: np.asarray(v) for n, v in jax.device_get(out).items()}
