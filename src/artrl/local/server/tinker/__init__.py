"""The Tinker API on the training server (`/api/v1/...`), as the unmodified `tinker` SDK calls it: sessions,
LoRA training clients on the server's shared model, forward / forward_backward / optim_step through futures
the client polls. Requires the `tinker` package on the server (its protobuf messages): `pip install tinker`."""
