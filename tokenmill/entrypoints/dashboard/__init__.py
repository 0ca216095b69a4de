"""`/dashboard`: a live page of what the engine is doing, served by the server itself."""
