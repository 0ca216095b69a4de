"""Starting the router and the processes behind it: `tokenmill router`'s flags and server, and
the one-command deployments `serve --data-parallel-size N` and `serve --disaggregate`, whose
instances a supervisor restarts and drains."""
