"""`tokenmill serve`'s HTTP server, one room per protocol and concern: `openai/` (completions,
chat, tokenization), `anthropic/` (Messages), `responses/` (OpenAI's Responses), `pooling/` (a
pooling model's server: embeddings, score, rerank), `replies/` (what a reply may be and how
it is read: tool calls, reasoning, structured outputs) and `transport/` (what every request
passes through: keys, body limits and checks, connections, errors, event streams). Here: the
app and its routes, the `serve` process, and the context every endpoint shares."""
