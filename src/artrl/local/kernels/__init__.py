"""Torch functions shared by the engine, the trainer and model loading: attention on the CPU, LoRA folded into weights."""
