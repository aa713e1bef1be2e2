"""Frozen models beside the policy: a teacher that scores rollouts for on-policy distillation."""

from rlax.teachers.config import TeacherConfig
from rlax.teachers.teacher import Teacher, check_tokenizers, row_passes
