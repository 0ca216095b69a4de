"""Response ids, and the replica tag in them that lets a router find a stored response.

Behind the router (`--data-parallel-size`, `tokenmill router`) each replica has its own
store, so a stored response exists only on the replica that made it. The router sends every
request with `x-tokenmill-replica-tag`, a tag of the replica it chose (a hash of its URL);
the replica writes it into the ids of the responses it makes, `resp_<tag>_<hex>`, and the
router sends a `previous_response_id`, a GET or a DELETE to the replica whose tag the id
carries. The router stays stateless (nothing to lose on its restart), and ids stay opaque
strings to clients. Without the header (a server on its own) ids are `resp_<hex>`.
"""

from __future__ import annotations

import hashlib
import re
import uuid

REPLICA_TAG_HEADER = "x-tokenmill-replica-tag"
_TAG = re.compile(r"[0-9a-f]{8}")
_TAGGED_ID = re.compile(r"resp_([0-9a-f]{8})_[0-9a-f]{32}")


def replica_tag(url: str) -> str:
    """The tag of the replica at `url` (stable for as long as its URL is)."""
    return hashlib.sha256(url.encode()).hexdigest()[:8]


def response_id(tag: str | None) -> str:
    """A new response id, carrying `tag` if it is one (a malformed header is ignored)."""
    if tag is not None and _TAG.fullmatch(tag):
        return f"resp_{tag}_{uuid.uuid4().hex}"
    return f"resp_{uuid.uuid4().hex}"


def tag_of(response_id: str) -> str | None:
    """The replica tag in a response id; None for an untagged or foreign one."""
    match = _TAGGED_ID.fullmatch(response_id)
    return match.group(1) if match else None
