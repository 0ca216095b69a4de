"""KV memory: how many blocks the cache gets (sizing), the blocks and the prefix cache (block
pool), and each request's block table over them (cache manager)."""
