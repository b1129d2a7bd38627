"""Saved runs read back from their folders: `artrl export`, `merge` and `serve` on a saved step."""
