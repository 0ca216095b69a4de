"""Where a benchmark's numbers were measured, recorded beside them: they mean little without it."""

from __future__ import annotations

import os
import platform
from datetime import datetime, timezone
from typing import Any


def machine_info() -> dict[str, Any]:
    """Where the numbers were measured: they mean little without it."""
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "num_cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()),  # others' work on a shared machine shows here
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
