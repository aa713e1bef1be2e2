"""Frozen models beside the policy: the teachers that score rollouts for on-policy distillation."""

from rlax.teachers.config import DEFAULT, TeacherConfig
from rlax.teachers.routing import Teachers, call_rows, programs_each, route
from rlax.teachers.teacher import Teacher, check_tokenizers, row_passes
