"""Which waiting request may join the running ones under LoRA: at most `max_loras` adapters
run at once (the runner's slots). As in vLLM's scheduler, a request whose adapter finds no
slot is passed over, keeping its place, while others behind it are admitted."""

from __future__ import annotations

from collections.abc import Iterable

from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.step.request import Request


def lora_fits(request: Request, running: Iterable[Request], max_loras: int) -> bool:
    """`request` may run beside `running`: it is a base request, its adapter is among theirs,
    or they use fewer than `max_loras` adapters."""
    if request.lora is None:
        return True
    active = {r.lora_int_id for r in running if r.lora is not None}
    return request.lora_int_id in active or len(active) < max_loras


def limit_lora_adapters(scheduler: Scheduler, max_loras: int) -> None:
    """Admit waiting requests to `scheduler` only while their adapters fit `max_loras`."""
    scheduler.waiting.admissible = lambda request: lora_fits(request, scheduler.running, max_loras)
