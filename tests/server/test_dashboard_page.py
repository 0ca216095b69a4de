"""The dashboard page before and after its first update, without a browser: the served HTML's
initial text, and the served script run by node against a stand-in DOM fed the real feed's
setup and (idle) update events. (tests/server/test_dashboard.py drives it in chromium.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.dashboard.feed import DashboardFeed

STATIC = resources.files("tokenmill.entrypoints.dashboard").joinpath("static")

# A DOM with just what dashboard.js touches; canvas drawing records the text it writes.
HARNESS = r"""
const [script, initial, setup, update] = JSON.parse(require("fs").readFileSync(0, "utf8"));
const texts = [];
const ctx = new Proxy({}, {
  get: (target, name) => name in target ? target[name]
    : name === "fillText" ? (text) => texts.push(text)
    : name === "measureText" ? () => ({ width: 10 }) : () => {},
  set: (target, name, value) => { target[name] = value; return true; },
});
const elements = {};
const element = (id) => elements[id] ??= {
  id, dataset: { ...(initial[id]?.dataset || {}) }, textContent: initial[id]?.text ?? "",
  hidden: initial[id]?.hidden ?? false, value: "", innerHTML: "", clientWidth: 600,
  clientHeight: 100, width: 300, height: 150, addEventListener() {}, getContext: () => ctx,
};
globalThis.document = { getElementById: element, documentElement: {} };
globalThis.getComputedStyle = () => ({ getPropertyValue: () => "#000" });
globalThis.window = { devicePixelRatio: 1 };
let source;
globalThis.EventSource = class { constructor() { source = this; this.on = {}; }
  addEventListener(name, f) { this.on[name] = f; } };
const seen = (id) => ({ state: element(id).dataset.state, text: element(id).textContent,
  hidden: element(id).hidden });
(0, eval)(script);
const report = {};
if (source.onopen) source.onopen();
report.opened = seen("connection");
source.on.setup({ data: JSON.stringify(setup) });
report.setUp = { connection: seen("connection"), steps: seen("steps-empty"),
  weights: seen("weights") };
source.on.update({ data: JSON.stringify(update) });
report.updated = { connection: seen("connection"), steps: seen("steps-empty"),
  latency: seen("latency-empty"), texts };
console.log(JSON.stringify(report));
"""


def served(name: str) -> str:
    return STATIC.joinpath(name).read_text()


def element_text(html: str, element_id: str) -> str:
    match = re.search(rf'<[^>]*id="{element_id}"[^>]*>(.*?)</', html)
    assert match, element_id
    return match.group(1)


def test_before_its_first_update_the_page_claims_nothing() -> None:
    html = served("dashboard.html")
    assert element_text(html, "connection") == "connecting"
    for empty in ("steps-empty", "latency-empty"):
        assert "Waiting for the server" in element_text(html, empty), empty
        assert "idle" not in element_text(html, empty)
    assert re.search(r'id="spec-off"[^>]*\bhidden\b', html)  # until setup says which


def test_every_canvas_has_a_fixed_css_height() -> None:
    """A canvas sized by its width alone (2:1) filled the viewport until the first update."""
    html, css = served("dashboard.html"), served("dashboard.css")
    canvases = re.findall(r'<canvas id="([^"]+)"', html)
    assert canvases
    for canvas in canvases:
        assert re.search(rf"#{canvas} {{ height: \d+px; }}", css), canvas


@pytest.fixture(scope="module")
def idle_feed_events(model_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A quantized engine's, so that the weight format is not the model's dtype."""
    config = EngineConfig(model=str(model_dir), max_model_len=128, quantization="int8")
    engine = LLMEngine(config)
    try:
        feed = DashboardFeed(AsyncEngine(engine, log_stats_interval=None), "m", {})
        return feed.setup(), feed.update()
    finally:
        engine.shutdown()


def test_the_setup_names_the_weight_format_as_v1_models_does(idle_feed_events) -> None:
    setup, _ = idle_feed_events
    assert setup["weight_format"].startswith("int8 (")
    assert "int8 lm_head" in setup["weight_format"]


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_the_page_goes_live_on_its_first_update_and_labels_no_empty_scale(
    idle_feed_events: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    html = served("dashboard.html")
    initial = {
        "connection": {"dataset": {"state": "connecting"}, "text": "connecting"},
        "steps-empty": {"text": element_text(html, "steps-empty")},
        "latency-empty": {"text": element_text(html, "latency-empty")},
    }
    setup, update = idle_feed_events
    stdin = json.dumps([served("dashboard.js"), initial, setup, update])
    ran = subprocess.run(
        ["node", "-e", HARNESS], input=stdin, capture_output=True, text=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    report = json.loads(ran.stdout)
    assert report["opened"]["state"] == "connecting"  # an open stream is not yet numbers
    assert report["setUp"]["connection"]["text"] == "connecting"
    assert "idle" not in report["setUp"]["steps"]["text"]
    assert report["setUp"]["weights"]["text"] == f"weights {setup['weight_format']}"
    updated = report["updated"]
    assert updated["connection"] == {"state": "live", "text": "live", "hidden": False}
    assert updated["steps"]["text"] == "No steps in this window: the engine is idle."
    assert updated["steps"]["hidden"] is False
    assert updated["latency"]["text"] == "No requests finished in this window."
    assert not [t for t in updated["texts"] if t.startswith("max") or "(max" in t]
