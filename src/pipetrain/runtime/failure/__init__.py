"""Runtime failure: how a failed or stuck rank becomes an error on every rank within a
bounded time (the watchdog, and the job's first failure in its store)."""
