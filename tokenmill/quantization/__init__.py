"""Quantized weights: which method each linear layer gets (`selection.py`), and the readers
of pre-quantized files (`gguf_file.py`). The methods themselves (how an int8 or int4 weight
is stored and multiplied) are in `layers/`: see docs/quantization.md."""
