"""OpenAI's Responses API (`/v1/responses`) as an adapter over the chat path, with a bounded
in-memory store for `previous_response_id`, GET and DELETE."""
