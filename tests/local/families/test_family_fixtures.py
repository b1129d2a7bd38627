"""The family models the tests run on are shipped (tests/family_fixtures.py): each is today's build, and the
build itself (`artrl tiny-model DIR --family NAME`) still makes a folder that loads and speaks the family's
template."""

from __future__ import annotations

import json

from family_fixtures import SHIPPED, shipped_folder

from artrl.local.families.family_models import FAMILY_MODELS, build_family_model


def test_every_family_has_its_shipped_model_and_no_stale_one_is_left():
    expected = {shipped_folder(f).name for f in FAMILY_MODELS}
    shipped = {p.name for p in SHIPPED.iterdir()}
    assert shipped == expected, (
        f"tests/family_models holds {sorted(shipped - expected)} but not {sorted(expected - shipped)}: a family's "
        "spec or family_models.py changed; run `python tests/family_fixtures.py` and commit tests/family_models"
    )
    for name in expected:
        for part in ("config.json", "model.safetensors", "tokenizer.json", "artrl_family_model.json"):
            assert (SHIPPED / name / part).is_file(), (name, part)


def test_a_family_model_builds_loads_and_speaks_its_template(tmp_path):
    """The build path the shipped folders came from, a few steps long (the fixtures: 300)."""
    import trl.chat_template_utils as trl_templates
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_family_model(tmp_path / "qwen2_5", "qwen2_5", steps=2)
    assert json.loads((folder / "artrl_family_model.json").read_text()) == {
        "family": "qwen2_5",
        "steps": 2,
        "seed": 0,
    }
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template == trl_templates.qwen2_5_chat_template
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in tokenizer.all_special_ids
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]
