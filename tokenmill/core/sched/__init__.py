"""Scheduling: which requests run each step and with how many tokens (the scheduler, its
waiting queue, the requests whose KV a connector moves), and a step's results applied to
them (the output applier, which decides who finished)."""
