"""KV connectors: moving KV blocks in and out of an engine (vLLM's `--kv-transfer-config`).

`base.py` is the seam the scheduler and the model runner call; `factory.py` picks a connector
by name; `storage.py` is the storage connector (blocks saved to a directory by content hash,
one file each: `block_file.py`); `p2p/` is the point-to-point connector (prompt KV pulled by a
decode instance from a prefill instance: prefill/decode disaggregation). What they share:
`blocks.py` (whole blocks in and out of the paged cache), `fingerprint.py` (what KV is valid
for).
"""
