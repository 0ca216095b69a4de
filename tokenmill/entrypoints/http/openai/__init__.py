"""OpenAI's completions, chat completions and vLLM's tokenization endpoints: their wire format
(`protocol.py`), the request fields to sampling, and the outputs to responses and streams."""
