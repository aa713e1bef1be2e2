"""Trainer → sampler weights: one versioned service, two transports (device_put; cross-process collective)."""

from rlax.weights.service import WeightsService
from rlax.weights.transports import CrossProcessTransport, DevicePutTransport, Transport
