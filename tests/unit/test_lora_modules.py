"""`--lora-modules` values, in both of vLLM's forms, and clear errors for malformed ones."""

from __future__ import annotations

import pytest

from tokenmill.entrypoints.http.lora_adapters import LoRAModule, parse_lora_module


def test_name_equals_path() -> None:
    assert parse_lora_module("sql=/a/b=c") == LoRAModule("sql", "/a/b=c")


def test_json_form_with_base_model_name() -> None:
    value = '{"name": "chat", "path": "/x", "base_model_name": "base"}'
    assert parse_lora_module(value) == LoRAModule("chat", "/x", "base")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("sql", "expected name=path"),
        ("=path", "expected name=path"),
        ('{"name": "x"', "not valid JSON"),
        ('{"name": "x"}', "'name' and 'path'"),
        ('{"name": "x", "path": "/p", "rank": 8}', "rank"),
    ],
)
def test_malformed_values_are_refused(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_lora_module(value)


def test_served_adapters_read_off_the_event_loop_thread() -> None:
    """A request's adapter is read on a worker thread, never on the event loop's."""
    import asyncio
    import threading

    from tokenmill.entrypoints.http.lora_adapters import ServedAdapters
    from tokenmill.lora.request import LoRARequest

    threads: list[str] = []

    class RecordingStore:
        def get(self, request: LoRARequest) -> None:
            threads.append(threading.current_thread().name)

    adapters = ServedAdapters(RecordingStore(), "base")  # type: ignore[arg-type]
    asyncio.run(adapters.loaded(LoRARequest("a", 1, "/a")))
    assert threads and threads[0] != threading.main_thread().name
