"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as an adapter
over the chat path: a body becomes a chat request, the chat reply becomes a message."""
