"""What every request passes through before and after a protocol sees it, whatever the API: the
listening socket and connection bounds, API keys, body size limits and whole-body checks, body
parsing off the event loop, middlewares, the error shape, server-sent event streams."""
