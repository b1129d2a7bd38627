"""Fixtures of the embedded engine's tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    """The tiny model in eval mode, loaded once per test module (for the HFEngine a test builds on it)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
