"""Prompt data: records, grain streams and mixtures, chat templates, synthetic tasks, curation."""

from rlax.data.chat import format_prompt
from rlax.data.curation import (Curriculum, decontaminate, estimate_pass_rates, exact_dedup,
                                filter_by_pass_rate, near_dedup)
from rlax.data.dynamic_sampling import GroupBuffer, informative_groups, refill_count
from rlax.data.pipeline import RecordIterator, make_dataset
from rlax.data.records import Record, iter_jsonl, read_records, write_jsonl
from rlax.data.synthetic import arithmetic, countdown, generate, program
from rlax.data.tokenizer import load_demo_tokenizer
