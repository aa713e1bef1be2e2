"""The runtime: the controller's thin loop, the run state (checkpoints), preemption, and failover."""

from rlax.runtime.controller import Controller
from rlax.runtime.run_state import NonFiniteError
