"""Which replica stored the response a request names: the tag in its id (ids.py explains
the scheme). A `previous_response_id` in a POST /v1/responses body, or the id in GET or
DELETE /v1/responses/{id}."""

from __future__ import annotations

import json

from tokenmill.entrypoints.http.responses.ids import tag_of

RESPONSES_PATH = "/v1/responses"


def stored_response_tag(method: str, path: str, body: bytes) -> str | None:
    """The replica tag of the stored response the request needs, if it needs one."""
    if path.startswith(RESPONSES_PATH + "/"):
        return tag_of(path.removeprefix(RESPONSES_PATH + "/"))
    if method != "POST" or path != RESPONSES_PATH:
        return None
    try:
        previous = json.loads(body).get("previous_response_id")
    except (ValueError, AttributeError):  # not a JSON object: the replica will say so
        return None
    return tag_of(previous) if isinstance(previous, str) else None
