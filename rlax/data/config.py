"""The `data` config section: which prompts a run trains and evaluates on, and how they are rendered."""

from __future__ import annotations

import dataclasses
import os

from rlax.data.records import Columns

_FILE_TYPES = (".jsonl", ".json", ".parquet")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Prompts: a built-in synthetic task or the user's files; the held-out split; how prompts are rendered.

  With `train_files` (comma-separated .jsonl / .json / .parquet files or `datasets` directories, schema in
  rlax.data.records; `*_key` map other column names, dotted paths allowed) the task fields are ignored; the
  eval set is `eval_files`, or else `n_eval` prompts held out of the training files.
  Prompts longer than rollout.max_prompt_len tokens after rendering are dropped and counted.
  """
  task: str = "arithmetic"          # a built-in task, "reasoning_gym:<dataset>", or a mixture "a=2,b=1"
  task_options: str = ""            # JSON: the task's options (reasoning-gym dataset config) or {task: options}
  difficulty: int = 1
  n_train: int = 4096
  n_eval: int = 128
  eval_seed: int = 12345
  prompt_style: str = "instruct"  # or "compact" (arithmetic, digit_sort)
  ops: str = ""                   # arithmetic: keep problems using only these operators
  train_files: str = ""
  eval_files: str = ""
  prompt_key: str = ""            # the files' field holding the prompt ("": "prompt")
  messages_key: str = ""          # ... the conversation ("": "messages")
  answer_key: str = ""            # ... the reference answer ("": "answer")
  answer_format: str = ""         # "gsm8k": the answer is the text after "####"
  template: str = "auto"          # "chat" (the tokenizer's chat template), "plain", or "auto"
  system_prompt: str = ""
  instruction: str = "{prompt}"   # the user turn; {prompt} is the record's prompt

  def files(self, which: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in getattr(self, f"{which}_files").split(",") if p.strip())

  def columns(self) -> Columns:
    return Columns(self.prompt_key, self.messages_key, self.answer_key, self.answer_format)

  def absolute(self) -> "DataConfig":
    """A copy whose file lists are absolute paths (resolved against the launching process's cwd)."""
    absolute = lambda spec: ",".join(os.path.abspath(os.path.expanduser(p)) for p in spec.split(",") if p.strip())
    return dataclasses.replace(self, train_files=absolute(self.train_files), eval_files=absolute(self.eval_files))

  def validate(self) -> "DataConfig":
    for ok, msg in (
        *((getattr(self, f) >= 1, f"data.{f}={getattr(self, f)} must be >= 1")
          for f in ("n_train", "n_eval", "difficulty")),
        (self.prompt_style in ("instruct", "compact"),
         f"data.prompt_style={self.prompt_style!r}: use 'instruct' or 'compact'"),
        (self.template in ("auto", "chat", "plain"), f"data.template={self.template!r}: use 'auto', 'chat' or 'plain'"),
        ("{prompt}" in self.instruction, f"data.instruction={self.instruction!r} must contain '{{prompt}}'"),
        (self.train_files or not self.eval_files, "data.eval_files needs data.train_files")):
      if not ok:
        raise ValueError(msg)
    self.columns()  # a bad answer_format is one error
    for which in ("train", "eval"):
      for path in self.files(which):
        if os.path.isdir(path.partition("#")[0]):
          continue  # a datasets directory
        if not path.endswith(_FILE_TYPES):
          raise ValueError(f"data.{which}_files: {path!r} is not a .jsonl, .json or .parquet file or a datasets "
                           "directory")
        if not os.path.isfile(path):
          raise ValueError(f"data.{which}_files: {path!r} does not exist")
    return self
