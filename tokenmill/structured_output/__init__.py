"""Structured outputs: JSON schema, regex, choice and EBNF grammars enforced while decoding."""

from tokenmill.sampling_params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
