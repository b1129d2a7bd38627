"""Recording unchanged agent code: every call inside a capture block, turned into trajectories."""
