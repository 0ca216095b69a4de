"""Quantized weights, one module a weight format: its checkpoint form, its `LinearMethod`
(storage, loading, packing for its kernel) and its entry in the registry (`int8.py`, `int4.py`,
with what both share in `int_codes.py`); which method each linear layer gets
(`selection.py`); the readers of pre-quantized checkpoints (`gguf_file.py`,
`hf_quantized.py`). See docs/quantization.md."""
