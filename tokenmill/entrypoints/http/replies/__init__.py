"""What a chat reply may be and how it is read, shared by chat, Messages and Responses: the
request's tools and structured-output fields as constraints, and the reply's text parsed into
reasoning, content and tool calls (one parser module per model family)."""
