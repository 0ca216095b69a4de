"""One module per decoder family, each declaring its `Family` (models/family.py); the
registry (models/registry.py) lists them."""
