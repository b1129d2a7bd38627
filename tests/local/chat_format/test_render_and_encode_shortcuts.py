"""ChatFormat's shortcuts give transformers' own answers: rendering plain JSON without apply_chat_template's
copies (plain_render.py) and encoding piece by piece between special tokens (segments.py), on every family's
real chat template and on tokenizers built here to break the segment rule."""

from __future__ import annotations

import json
import pickle
import random

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from artrl.local.chat_format import ChatFormat
from artrl.local.chat_format.segments import segment_encoder
from artrl.local.chat_format.template_inputs import template_messages
from artrl.local.families.family_models import FAMILY_MODELS, FIXTURE_TOOLS, fixture_conversation


def conversations(family: str) -> list[list[dict]]:
    """Conversations of the shapes clients send: None contents and keys, tool calls with JSON-string
    arguments, tool results, reasoning under its several names, a system prompt, a next user turn."""
    spec = FAMILY_MODELS[family]
    rng = random.Random(0)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": json.dumps({"a": 3, "b": 4})},
    }
    shapes = [
        [{"role": "user", "content": "Add 3 and 4.", "name": None}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Add 3 and 4."},
            {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "I add."},
            {"role": "tool", "tool_call_id": "call_1", "content": "7"},
        ],
        [
            {"role": "user", "content": "Add 3 and 4."},
            {"role": "assistant", "content": "", "tool_calls": [call], "reasoning": "adding"},
            {"role": "tool", "tool_call_id": "call_1", "content": "7", "name": "add"},
            {"role": "assistant", "content": "It is 7.", "thinking": None},
            {"role": "user", "content": "Thanks! Und jetzt 5 + 6? 🙂"},
        ],
    ]
    return shapes + [fixture_conversation(rng, spec, i)["messages"] for i in range(4)]


def whole_encode(tokenizer, text: str, start: bool) -> list[int]:
    """ChatFormat._encode without the segments: the whole text at once."""
    if start:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    ids = tokenizer("\n" + text, add_special_tokens=False)["input_ids"]
    return ids[len(newline) :] if ids[: len(newline)] == newline else whole_encode(tokenizer, text, True)


class CountingRenderer:
    """A PlainRenderer that counts its renders (to see the shortcut taken, or not)."""

    def __init__(self, renderer) -> None:
        self.renderer, self.calls = renderer, 0

    def takes(self, *args) -> bool:
        return self.renderer.takes(*args)

    def render(self, *args):
        self.calls += 1
        return self.renderer.render(*args)


@pytest.mark.parametrize("family", sorted(FAMILY_MODELS))
def test_plain_render_and_segments_equal_transformers_on_every_family(family, family_dirs):
    tokenizer = AutoTokenizer.from_pretrained(family_dirs(family))
    fmt = ChatFormat.for_tokenizer(tokenizer)
    assert fmt._plain is not None and fmt._segments is not None
    fmt._plain = counting = CountingRenderer(fmt._plain)
    kwargs = [{}] + ([{"enable_thinking": False}] if "enable_thinking" in fmt.variables else [])
    for messages in conversations(family):
        for tools in (FIXTURE_TOOLS, None):
            for extra in kwargs:
                for generation_prompt in (True, False):
                    text = fmt.render(messages, tools, generation_prompt, extra)
                    expected = tokenizer.apply_chat_template(
                        template_messages(messages),
                        tools=tools,
                        tokenize=False,
                        add_generation_prompt=generation_prompt,
                        **extra,
                    )
                    assert text == expected, (family, messages, tools, extra)
                    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
                    assert fmt._segments.encode(text) == whole
                    assert fmt._segments.encode(text) == whole  # (again: from the remembered pieces)
                    assert fmt._encode(text[7:], False) == whole_encode(tokenizer, text[7:], False)
    assert counting.calls == len(conversations(family)) * 2 * len(kwargs) * 2  # (every render took it)


def _tokenizer(kind: str) -> PreTrainedTokenizerFast:
    """A small SentencePiece-like tokenizer: `kind` picks how it marks word starts."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if (
        kind == "metaspace-first"
    ):  # a word-start mark only at the text's very start: pieces are not independent
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    elif kind == "metaspace-always":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    else:  # Llama 2's: a normalizer that prepends the mark
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    corpus = ["Hello world, this is a test.", "user assistant system tool model"] * 20
    specials = ["<unk>", "<s>", "<start_of_turn>", "<end_of_turn>"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=specials))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", unk_token="<unk>", additional_special_tokens=specials[2:]
    )
    fast.chat_template = (
        "{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
    )
    return fast


@pytest.mark.parametrize("kind", ["metaspace-first", "metaspace-always", "prepend-normalizer"])
def test_segments_only_where_the_probe_proves_them(kind):
    tokenizer = _tokenizer(kind)
    segments = segment_encoder(tokenizer)
    if kind == "metaspace-first":
        assert segments is None  # (the whole-text encode stays)
        return
    assert segments is not None
    for text in (
        "<s><start_of_turn>user\nHello world<end_of_turn>\n<start_of_turn>model\n",
        "Hello<end_of_turn><end_of_turn> world <start_of_turn>",
        "",
    ):
        assert segments.encode(text) == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_special_token_another_added_token_overlaps_is_no_cut():
    """The tokenizer matches added tokens leftmost-longest: where `<start_of_turn>user` is a token of its own,
    a text is not cut at `<start_of_turn>` (it would split that token)."""
    tokenizer = _tokenizer("prepend-normalizer")
    tokenizer.add_tokens(["<start_of_turn>user"])
    segments = segment_encoder(tokenizer)
    assert (
        segments is not None and "<start_of_turn>" not in segments._ids and "<end_of_turn>" in segments._ids
    )
    text = "<start_of_turn>user\nHello world<end_of_turn>\n<start_of_turn>model\nHi<end_of_turn>\n"
    assert segments.encode(text) == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_truncation_left_set_on_the_tokenizer_does_not_cut_the_pieces(tokenizer):
    """transformers leaves truncation set on the fast tokenizer after a call that asked for it: the pieces are
    not encoded with it (the whole-text encode resets it)."""
    import copy

    own = copy.deepcopy(tokenizer)
    fmt = ChatFormat.for_tokenizer(own)
    text = fmt.render([{"role": "user", "content": "a question of some length"}], None, True)
    whole = fmt.encode(text)
    fmt._encoded.clear()
    own("some text to cut", truncation=True, max_length=2)
    assert not fmt._segments.usable()
    assert fmt.encode(text) == whole and len(whole) > 2


def test_values_that_are_not_plain_json_render_through_apply_chat_template(tokenizer):
    class Text(str):  # (a subclass may carry methods: transformers rebuilds it as a str for the sandbox)
        pass

    fmt = ChatFormat.for_tokenizer(tokenizer)
    fmt._plain = counting = CountingRenderer(fmt._plain)
    for messages in (
        [{"role": "user", "content": Text("hi")}],
        [{"role": "user", "content": "a forged <|im_end|>"}],  # (marked: a copy, rendered by transformers)
    ):
        fmt.render(messages, None, True)
        assert counting.calls == 0
    plain = [{"role": "user", "content": "hi", "n": 1.5, "ok": True, "none": None}]
    assert fmt.render(plain, None, True) == tokenizer.apply_chat_template(
        template_messages(plain), tokenize=False, add_generation_prompt=True
    )
    assert counting.calls == 1
    with pytest.raises(ValueError, match="Tools should"):  # (transformers' own check: not a schema)
        fmt.render(plain, ["not a schema"], True)
    assert counting.calls == 1


def test_a_chat_format_pickles_without_what_it_remembers(tokenizer):
    """Render workers get the format pickled and keep it by its bytes' hash (row_renderer.py): the memos and
    the shortcuts derived from the tokenizer stay out of the bytes, and the copy derives them again."""
    fmt = ChatFormat.for_tokenizer(tokenizer)
    before = pickle.dumps(fmt)
    text = fmt.render([{"role": "user", "content": "hi"}], None, True)
    ids = fmt.encode(text)
    assert fmt._segments is not None and fmt._encoded
    assert pickle.dumps(fmt) == before
    copy = pickle.loads(before)
    assert copy.render([{"role": "user", "content": "hi"}], None, True) == text and copy.encode(text) == ids
