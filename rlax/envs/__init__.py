"""Episodes, every rollout's shape: the environment protocol, chat-template renderers, tools, the episode
stream over the sampler (multi-turn, tool-using), one-turn episodes (single-turn runs), and the registry."""

from rlax.envs.base import (CALL_OUTCOMES, STOP_REASONS, EnvContext, Environment, Observation,
                            StepResult, Turn)
from rlax.envs.config import EnvConfig
from rlax.envs.episodes import EpisodeStream, FinishedEpisodes, batch_stats
from rlax.envs.journal import ToolJournal
from rlax.envs.one_turn import OneTurnEpisodes, single_turn_episodes
from rlax.envs.registry import get, names, register
from rlax.envs.renderers import JsonCalls, ParsedTurn, Renderer, TagCalls, ToolCall, renderer
from rlax.envs.search_env import SearchEnv
from rlax.envs.tool_env import CalculatorEnv, RetryEnv, SingleTurnEnv, ToolEnv
from rlax.envs.tools import Tool, ToolResult, ToolRunner, calculator
