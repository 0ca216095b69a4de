"""Built-in demo models trained on a synthetic corpus: a target, its speculative draft, and
speculative heads on the target (EAGLE, Medusa).

The weights ship inside the package (`weights/target`, `weights/draft`, `weights/eagle`,
`weights/medusa`), so nobody has to train them to use them; `python -m demo_training.train`
rebuilds the models and `python -m demo_training.train_heads` the heads, from seeds.
"""

from __future__ import annotations

from pathlib import Path

WEIGHTS_DIR = Path(__file__).parent / "weights"
DEMO_MODEL_NAMES = ("target", "draft", "eagle", "medusa")
# What each speculative method drafts with by default for the demo target.
DEFAULT_DRAFTS = {"draft_model": "draft", "eagle": "eagle", "medusa": "medusa"}
DEMO_TARGET_NAME = "tokenmill-demo-target"  # the served model name when no model is given


def demo_model_path(name: str = "target") -> Path:
    """The shipped directory of the demo `target`, `draft`, `eagle` or `medusa` weights."""
    if name not in DEMO_MODEL_NAMES:
        raise ValueError(f"unknown demo model {name!r}; one of {list(DEMO_MODEL_NAMES)}")
    path = WEIGHTS_DIR / name
    if not (path / "config.json").is_file():
        command = "train_heads" if name in ("eagle", "medusa") else f"train --model {name}"
        raise FileNotFoundError(
            f"demo model {name!r} is missing at {path}; rebuild it with "
            f"`python -m demo_training.{command}` (in a checkout of the repository)"
        )
    return path


def default_draft_for(model_dir: str | Path, method: str = "draft_model") -> Path | None:
    """What `{"method": METHOD}` without a model drafts with: the demo draft (draft_model)
    or heads (eagle, medusa) when `model_dir` is the demo target (or a copy of it), else
    None."""
    info_file = Path(model_dir) / "tokenmill_demo.json"
    if not info_file.is_file():
        return None
    target_info = (WEIGHTS_DIR / "target" / "tokenmill_demo.json").read_text()
    if method not in DEFAULT_DRAFTS or info_file.read_text() != target_info:
        return None
    return demo_model_path(DEFAULT_DRAFTS[method])
