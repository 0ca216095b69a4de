"""The server test-suite's key behaviours (completions, chat, streaming, errors, /v1/models,
tokenize), run unchanged through the router (this directory's conftest points the fixtures at
`tokenmill serve --data-parallel-size 2`)."""

from __future__ import annotations

from test_chat import *  # noqa: F403
from test_completions import *  # noqa: F403
from test_errors import *  # noqa: F403
from test_tokenize import *  # noqa: F403
