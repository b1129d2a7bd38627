"""Engines: what the gateway needs from one (`contract`), the embedded engine (`hf/`) and vLLM (`vllm/`)."""
