"""Trainer → sampler weights: one versioned service, its transports (device_put; cross-process collective;
LoRA adapters merged into the sampler's pristine base)."""

from rlax.weights.service import WeightsService
from rlax.weights.transports import AdapterTransport, CrossProcessTransport, DevicePutTransport, Transport
