"""Paged attention, one module per backend family: what every backend shares (`base.py`:
the step's metadata and the `PagedAttention` base class), the portable PyTorch backend
(`torch_backend.py`), the CPU one on the native kernel (`cpu_backend.py`), the Triton one
(`triton_backend.py`), and the choice among them (`selector.py`)."""
