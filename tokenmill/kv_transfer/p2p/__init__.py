"""The point-to-point KV connector: prompt KV pulled from a prefill instance by a decode
instance over torch.distributed (`connector.py`; the wire: `channel.py`, `sender.py`,
`receiver.py`; the request fields: `params.py`)."""
