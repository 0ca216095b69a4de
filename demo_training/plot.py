"""Loss curves of the demo models' training runs, as one PNG for the docs."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on a training box
import matplotlib.pyplot as plt

from demo_training.config import DEMO_MODELS


def plot_loss_curves(work_dir: Path, out_path: Path) -> None:
    """Left: training loss of every run under work_dir; right: validation loss per task."""
    runs = {
        p.parent.name: json.loads(p.read_text()) for p in sorted(work_dir.glob("*/history.json"))
    }
    if not runs:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), dpi=80)
    for name, history in runs.items():
        steps = [h["step"] for h in history["train"]]
        left.plot(steps, [h["loss"] for h in history["train"]], label=f"{name} train")
        val_steps = [h["step"] for h in history["val"]]
        left.plot(
            val_steps, [h["losses"]["all"] for h in history["val"]], "--", label=f"{name} val"
        )
    left.set(xlabel="step", ylabel="loss (learned tokens)", yscale="log", title="loss")
    left.legend()
    target = runs.get("target") or next(iter(runs.values()))
    val_steps = []
    if target["val"]:
        val_steps = [h["step"] for h in target["val"]]
        for task in target["val"][-1]["losses"]:
            if task != "all":
                right.plot(val_steps, [h["losses"].get(task) for h in target["val"]], label=task)
    polish_start = DEMO_MODELS["target"].train.num_steps
    if DEMO_MODELS["target"].polish is not None and val_steps and val_steps[-1] > polish_start:
        for axis in (left, right):
            axis.axvline(polish_start, color="gray", linestyle=":", linewidth=1)
        right.annotate("polish", (polish_start, 1.0), xytext=(4, 0), textcoords="offset points")
    right.set(xlabel="step", ylabel="validation loss", yscale="log", title="target, per task")
    right.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
