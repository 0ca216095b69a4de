"""Structured outputs: JSON schema, regex, choice and EBNF grammars enforced while decoding."""

from tokenmill.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
