"""Response ids name the replica that stored them; the router reads the name back from a
`previous_response_id` or a /v1/responses/{id} path, and from nothing else."""

from __future__ import annotations

import json

import pytest

from tokenmill.entrypoints.http.responses.ids import replica_tag, response_id, tag_of
from tokenmill.entrypoints.router.balancing.response_affinity import stored_response_tag

TAG = replica_tag("http://127.0.0.1:8001")


def test_ids_carry_a_well_formed_tag_only() -> None:
    assert tag_of(response_id(TAG)) == TAG != replica_tag("http://127.0.0.1:8002")
    assert tag_of(response_id(None)) is None
    assert tag_of(response_id("../../etc")) is None  # a malformed header is ignored
    assert response_id("../../etc").startswith("resp_") and "/" not in response_id("../..")


@pytest.mark.parametrize(
    ("method", "path", "body", "owner"),
    [
        ("POST", "/v1/responses", {"input": "x", "previous_response_id": "ID"}, TAG),
        ("GET", "/v1/responses/ID", None, TAG),
        ("DELETE", "/v1/responses/ID", None, TAG),
        ("POST", "/v1/responses", {"input": "x"}, None),
        ("POST", "/v1/responses", {"previous_response_id": "resp_untagged"}, None),
        ("POST", "/v1/responses", {"previous_response_id": 7}, None),
        ("POST", "/v1/responses", [1, 2], None),
        ("POST", "/v1/chat/completions", {"previous_response_id": "ID"}, None),
    ],
)
def test_the_router_reads_the_owner_of_the_named_response(method, path, body, owner) -> None:
    stored = response_id(TAG)
    path = path.replace("ID", stored)
    raw = json.dumps(body).replace("ID", stored).encode() if body is not None else b""
    assert stored_response_tag(method, path, raw) == owner


def test_a_body_that_is_not_json_has_no_owner() -> None:
    assert stored_response_tag("POST", "/v1/responses", b"{not json") is None
