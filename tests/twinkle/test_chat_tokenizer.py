"""The API's chat template rendering (tokenizers + jinja2, no transformers) gives the ids transformers gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from twinkle.chat_tokenizer import ChatTokenizer
from twinkle.errors import InvalidRequest

CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another, with ünïcödé?"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_rendered_and_encoded_chats_match_transformers(tiny_model_dir: Path, messages: list[dict[str, str]]) -> None:
    ours = ChatTokenizer(tiny_model_dir)
    theirs = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = ours.render(messages)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ours.encode(text, add_special_tokens=False) == list(expected)
    assert ours.encode("plain text", add_special_tokens=True) == theirs("plain text")["input_ids"]
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.decode(ours.encode("round trip", add_special_tokens=False)) == "round trip"


def test_a_template_kept_in_tokenizer_config_is_used_and_a_missing_one_is_a_clear_error(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    template = (copy / "chat_template.jinja").read_text()
    (copy / "chat_template.jinja").unlink()
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    assert ChatTokenizer(copy).render(CONVERSATIONS[0]) == ChatTokenizer(tiny_model_dir).render(CONVERSATIONS[0])
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequest, match="no chat template"):
        ChatTokenizer(copy).render(CONVERSATIONS[0])


def test_a_template_that_raises_becomes_a_user_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    (copy / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must come first') }}{% endif %}")
    with pytest.raises(InvalidRequest, match="a system message must come first"):
        ChatTokenizer(copy).render(CONVERSATIONS[0])


def test_a_token_holding_part_of_a_character_is_listed_by_its_own_bytes(tiny_model_dir: Path) -> None:
    tokenizer = ChatTokenizer(tiny_model_dir)
    ids = tokenizer.encode("naïve café", add_special_tokens=False)

    assert b"".join(tokenizer.token_bytes(token) for token in ids).decode() == "naïve café"
    partial = [token for token in ids if tokenizer.token_text(token) == "\ufffd"]
    assert partial and all(tokenizer.token_key(token).startswith("bytes:\\x") for token in partial)
    assert len({tokenizer.token_key(token) for token in partial}) == len(set(partial))  # distinct, unlike U+FFFD
    assert tokenizer.token_key(ids[0]) == tokenizer.token_text(ids[0]) == "n"
