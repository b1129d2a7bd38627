"""Heavy parts of artrl (torch, transformers, fastapi). Import explicitly; `import artrl` never does."""
