"""`--slo`: the latency targets the dashboard's goodput counts requests against."""

from __future__ import annotations

import pytest

from tokenmill.entrypoints.dashboard.slo import parse_slo


def test_slos_are_read_in_seconds_with_ms_for_bare_numbers() -> None:
    assert parse_slo("ttft=500ms, tpot=0.05s,e2el=2000") == {"ttft": 0.5, "tpot": 0.05, "e2el": 2.0}
    assert parse_slo(None) == parse_slo("") == {}


@pytest.mark.parametrize(
    "text", ["ttft", "itl=50ms", "ttft=fast", "ttft=-1ms", "tpot=0", "ttft=nan"]
)
def test_a_bad_slo_is_rejected_with_its_text(text: str) -> None:
    with pytest.raises(ValueError, match="--slo"):
        parse_slo(text)
