"""The embedded engine: transformers inference in a thread, continuous batching, KV and prefix caches, fused decode."""
