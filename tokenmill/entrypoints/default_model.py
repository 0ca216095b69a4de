"""The built-in demo models as defaults, filled in at the entrypoints so the engine itself
never needs to know about them: no model means the demo target, and a draft-model
speculative config without a model drafts with the demo draft (or the demo EAGLE / Medusa
heads) when the target is the demo's."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from tokenmill.config import EngineConfig
from tokenmill.config.speculative import MODEL_FREE_METHODS
from tokenmill.demo import DEMO_TARGET_NAME, default_draft_for, demo_model_path

logger = logging.getLogger(__name__)


def with_default_models(config: EngineConfig) -> EngineConfig:
    """`config` with the demo target and draft wherever it names no model."""
    if config.model is None:
        path = demo_model_path("target")
        logger.info("no model given: using the built-in demo model %s (%s)", DEMO_TARGET_NAME, path)
        config = dataclasses.replace(config, model=str(path))
    spec = config.speculative_config
    if spec is not None and spec.method not in MODEL_FREE_METHODS and not spec.model:
        draft = default_draft_for(Path(config.model), spec.method)
        if draft is not None:
            config = dataclasses.replace(
                config, speculative_config=dataclasses.replace(spec, model=str(draft))
            )
    return config
