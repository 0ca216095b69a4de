"""The adapters kept loaded in host memory: read once from disk (peft's directory or a
GGUF file), at most --max-cpu-loras of them (least recently used dropped first; a request in
flight keeps its own reference, so an adapter dropped here still runs to the end of its
requests). Safe on any thread: the server loads on a worker thread, off the engine's step
loop."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from tokenmill.lora.gguf_adapter import is_gguf_adapter, read_gguf_adapter
from tokenmill.lora.peft_adapter import BaseShapes, PeftAdapter, read_peft_adapter
from tokenmill.lora.request import LoRARequest


class LoRAAdapterStore:
    def __init__(self, base: BaseShapes, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.base = base
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self._adapters: OrderedDict[int, tuple[LoRARequest, PeftAdapter]] = OrderedDict()
        self._lock = threading.Lock()
        self.load_seconds: list[float] = []  # each load from disk, since start

    def get(self, request: LoRARequest) -> PeftAdapter:
        """The adapter `request` names, read from disk unless loaded; raises
        `LoRAAdapterError` for one that cannot run on this base model."""
        with self._lock:
            known = self._adapters.get(request.lora_int_id)
            if known is not None and known[0] == request:
                self._adapters.move_to_end(request.lora_int_id)
                return known[1]
        start = time.perf_counter()
        read = read_gguf_adapter if is_gguf_adapter(request.lora_path) else read_peft_adapter
        adapter = read(
            request.lora_path,
            request.lora_name,
            request.lora_int_id,
            self.base,
            self.max_lora_rank,
        )
        with self._lock:
            self.load_seconds.append(time.perf_counter() - start)
            self._adapters[request.lora_int_id] = (request, adapter)
            self._adapters.move_to_end(request.lora_int_id)
            while len(self._adapters) > self.max_cpu_loras:
                self._adapters.popitem(last=False)
        return adapter

    def remove(self, lora_int_id: int) -> None:
        with self._lock:
            self._adapters.pop(lora_int_id, None)

    @property
    def loaded_ids(self) -> list[int]:
        with self._lock:
            return list(self._adapters)
