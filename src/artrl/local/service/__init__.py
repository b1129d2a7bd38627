"""One served model: weights, engine, trainer and gateway wired together; its checkpoints and committed steps."""
