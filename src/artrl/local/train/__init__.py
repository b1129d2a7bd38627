"""Training: rows from trajectories, advantages, the loss, packing, the trainer's forward and step; `ranks/` for N processes."""
