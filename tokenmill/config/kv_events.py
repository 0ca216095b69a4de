"""`--kv-events-config`: KV cache events for the routers in front (llm-d, vLLM's router)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.config.base import ConfigError, check_choice, json_config_fields

# "null" publishes nothing (vLLM's default publisher); "zmq" a PUB socket in vLLM's format.
KV_EVENT_PUBLISHERS = ("null", "zmq")


@dataclass
class KVEventsConfig:
    """`--kv-events-config` as vLLM takes it, e.g. `{"enable_kv_cache_events": true,
    "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}`: the prefix cache's
    blocks stored and removed, published so a router can send a prompt where its prefix is
    cached (docs/scale_out.md). `replay_endpoint`, a ROUTER socket that answers a sequence
    number with the batches kept since it (the last `buffer_steps`)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000  # the PUB socket's send high-water mark, in messages
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @classmethod
    def parse(cls, value: str | dict[str, Any] | KVEventsConfig | None) -> KVEventsConfig | None:
        if value is None or isinstance(value, KVEventsConfig):
            return value
        return cls(**json_config_fields(value, "kv_events_config", cls))

    def __post_init__(self) -> None:
        check_choice("kv_events_config publisher", self.publisher, KV_EVENT_PUBLISHERS)
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError("enable_kv_cache_events must be true or false")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"kv_events_config {name} must be a string")
        if self.publisher == "zmq" and not self.endpoint:
            raise ConfigError("kv_events_config needs an endpoint for the zmq publisher")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"kv_events_config {name} must be an integer >= 1")

    @property
    def publishes(self) -> bool:
        """Whether events are collected and sent anywhere."""
        return self.enable_kv_cache_events and self.publisher != "null"
