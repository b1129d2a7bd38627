"""The client side of a training server on another machine: `artrl.RemoteBackend` (light: no torch)."""
