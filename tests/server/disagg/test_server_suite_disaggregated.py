"""The server test-suite's key behaviours (completions, chat, streaming, errors, tokenize), run
unchanged through `tokenmill serve --disaggregate` (this directory's conftest): the OpenAI
API is the same for a client whether one engine or a prefill/decode pair answers."""

from __future__ import annotations

from test_chat import *  # noqa: F403
from test_completions import *  # noqa: F403
from test_errors import *  # noqa: F403
from test_tokenize import *  # noqa: F403
