"""Test support, not part of the installed package: random-weight checkpoints (Hugging Face,
pre-quantized, GGUF, speculative heads) for the tests and benchmarks, the engine the tests
make of them (`engines.py`), and the import-graph checker of docs/architecture.md's layers
(`python -m tokenmill_testing.import_graph`)."""
