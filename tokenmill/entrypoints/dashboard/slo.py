"""`--slo ttft=500ms,tpot=50ms`: the latency targets goodput counts requests against."""

from __future__ import annotations

# The per-request latencies a target can be set on, named as `tokenmill bench serve --goodput`
# names them.
SLO_METRICS = ("ttft", "tpot", "e2el")
_UNITS = {"ms": 1e-3, "s": 1.0}


def parse_slo(text: str | None) -> dict[str, float]:
    """`"ttft=500ms,tpot=0.05s"` -> `{"ttft": 0.5, "tpot": 0.05}` in seconds. A bare number
    is milliseconds, as in `--goodput`."""
    slos: dict[str, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--slo takes NAME=VALUE with NAME in {SLO_METRICS}, got {item!r}")
        slos[name] = _seconds(name, value)
    return slos


def _seconds(name: str, value: str) -> float:
    unit = next((u for u in ("ms", "s") if value.endswith(u)), "")
    number = value[: len(value) - len(unit)] if unit else value
    try:
        seconds = float(number) * _UNITS[unit or "ms"]
    except ValueError:
        raise ValueError(f"--slo {name}={value!r} is not a time like 500ms or 0.5s") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"--slo {name}={value!r} must be a positive time")
    return seconds
