"""Running rollouts: groups gathered concurrently, scenarios in steps, retries, rollouts ahead of training."""
