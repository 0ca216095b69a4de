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
    spec = DEMO_MODELS["target"]
    start = spec.train.num_steps
    for name, schedule in (("polish", spec.polish), ("tools", spec.tools)):
        if schedule is None:
            continue
        if val_steps and val_steps[0] < start < val_steps[-1]:  # a run that crossed it
            for axis in (left, right):
                axis.axvline(start, color="gray", linestyle=":", linewidth=1)
            right.annotate(name, (start, 1.0), xytext=(4, 0), textcoords="offset points")
        start += schedule.num_steps
    right.set(xlabel="step", ylabel="validation loss", yscale="log", title="target, per task")
    right.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
