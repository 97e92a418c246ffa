"""Helpers that drive real ranks in-process for tests and benchmarks (a pool
of gloo processes, a rank's engine stepped by hand). Not used by the server."""
