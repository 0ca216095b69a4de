"""`python -m benchmarks.peers`: tokenmill against vLLM's CPU build and llama.cpp (vs_peers.py)."""

from benchmarks.peers.vs_peers import main

main()
