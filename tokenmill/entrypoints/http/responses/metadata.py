"""`metadata` within OpenAI's limits: at most 16 pairs, keys at most 64 characters, values
strings of at most 512. Stored with the response, so unbounded metadata would let one client
grow the server's memory (1,000 responses of 1.8 MiB metadata each took 2 GiB)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

from tokenmill.entrypoints.http.transport.body_checks import InvalidBodyError

MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def check_metadata(metadata: dict[str, str]) -> dict[str, str]:
    """`metadata` unchanged, or InvalidBodyError (a 400) naming the limit it passes."""
    if len(metadata) > MAX_METADATA_KEYS:
        raise InvalidBodyError(
            "metadata",
            f"at most {MAX_METADATA_KEYS} key-value pairs, got {len(metadata)}",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise InvalidBodyError(
                "metadata",
                f"keys are at most {MAX_METADATA_KEY_CHARS} characters, got one of {len(key)}",
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidBodyError(
                f"metadata.{key}",
                f"values are strings of at most {MAX_METADATA_VALUE_CHARS} characters, got "
                f"{len(value)}",
            )
    return metadata


Metadata = Annotated[dict[str, str], AfterValidator(check_metadata)]
