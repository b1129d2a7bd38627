"""Threads and child processes (stdlib and torch's thread count): idle-ending executors, piped children, shielded work."""
