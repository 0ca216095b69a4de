"""`tokenmill router`: one OpenAI endpoint in front of several `tokenmill serve` replicas
(docs/scale_out.md)."""
