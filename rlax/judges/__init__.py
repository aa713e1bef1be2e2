"""Generative judges: a frozen model that reads each reply and writes the verdict that becomes its reward."""

from rlax.judges.config import JudgeConfig
from rlax.judges.judge import USES, Judge, JudgeReward, engine, sizes
