"""Built-in demo models trained on a synthetic corpus: a target and its speculative draft.

The weights ship inside the package (`weights/target`, `weights/draft`), so nobody has to
train them to use them; `python -m tokenmill.demo.train` rebuilds them from seeds.
"""

from __future__ import annotations

from pathlib import Path

WEIGHTS_DIR = Path(__file__).parent / "weights"
DEMO_MODEL_NAMES = ("target", "draft")
DEMO_TARGET_NAME = "tokenmill-demo-target"  # the served model name when no model is given


def demo_model_path(name: str = "target") -> Path:
    """The shipped checkpoint directory of the demo `target` or `draft` model."""
    if name not in DEMO_MODEL_NAMES:
        raise ValueError(f"unknown demo model {name!r}; one of {list(DEMO_MODEL_NAMES)}")
    path = WEIGHTS_DIR / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"demo model {name!r} is missing at {path}; rebuild it with "
            f"`python -m tokenmill.demo.train --model {name}`"
        )
    return path


def default_draft_for(model_dir: str | Path) -> Path | None:
    """The draft to use for `{"method": "draft_model"}` without a model: the demo draft when
    `model_dir` is the demo target (or a copy of it), else None."""
    info_file = Path(model_dir) / "tokenmill_demo.json"
    if not info_file.is_file():
        return None
    target_info = (WEIGHTS_DIR / "target" / "tokenmill_demo.json").read_text()
    return demo_model_path("draft") if info_file.read_text() == target_info else None
