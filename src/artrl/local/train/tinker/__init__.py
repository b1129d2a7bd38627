"""The Tinker API's training calls on artrl's trainer: its built-in losses (losses.py) and forward /
forward_backward / optim_step over a `Trainer`'s model and optimizer (steps.py)."""
