"""KV connectors: moving KV blocks in and out of an engine (vLLM's `--kv-transfer-config`).

`base.py` is the seam the scheduler and the model runner call; `factory.py` picks a connector
by name; `storage.py` is the storage connector (blocks saved to a directory by content hash).
"""
