"""The training server (`artrl server`): one base model, the trainable models of many tenants on it, over
HTTP — the client API of `LocalBackend` (register, train, train_sft, log, checkpoints) for
`artrl.RemoteBackend`, and one OpenAI-compatible gateway in front of every model."""
