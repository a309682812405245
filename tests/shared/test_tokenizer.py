"""Tokenizer: same ids and chat rendering as transformers; detokenization emits whole UTF-8 only."""

import pytest

from edgecore.shared.text.tokenizer import IncrementalDetokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_tok(model_dir):
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.mark.parametrize("text", ["The for statement", "héllo wörld — ünïcode ✓ 🙂", "  spaced\n\ttabs", ""])
def test_encode_decode_match_transformers(tokenizer, hf_tok, text):
    assert tokenizer.encode(text) == hf_tok(text)["input_ids"]
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_chat_template_matches_transformers(tokenizer, hf_tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"},
                {"role": "assistant", "content": "A sequence."}, {"role": "user", "content": "And a dict?"}]
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ref = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours == ref
    ref_ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ref_ids, dict) or hasattr(ref_ids, "input_ids"):
        ref_ids = ref_ids["input_ids"]
    assert tokenizer.encode_chat(messages) == list(ref_ids)
    assert tokenizer.encode_chat(messages).count(tokenizer.bos_token_id) == 1


def test_incremental_detokenization_only_complete_utf8(tokenizer):
    text = "naïve café — 🙂 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [tokenizer.bos_token_id])
    deltas = [detok.push(t) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # The emoji spans several byte tokens: some pushes must have returned nothing.
    assert any(d == "" for d in deltas[:-1])


def test_a_limit_refuses_a_certainly_longer_text_from_a_prefix_and_changes_nothing_else(model_dir):
    from edgecore.shared.text.tokenizer import TextTooLong, Tokenizer
    tok = Tokenizer.from_dir(model_dir)
    text = (model_dir / "heldout.txt").read_text()
    ids = tok.encode(text)
    encoded = []
    real = tok.backend

    class Recording:            # what the library is asked to encode
        def __getattr__(self, name):
            return getattr(real, name)

        def encode(self, t, **kw):
            encoded.append(len(t))
            return real.encode(t, **kw)

    tok.backend = Recording()
    for limit in (10, 100, 1000):       # texts far longer than 16 characters per allowed token: a prefix decides
        encoded.clear()
        with pytest.raises(TextTooLong) as info:
            tok.encode(text, limit=limit)
        assert limit < info.value.at_least <= len(ids)
        assert max(encoded) < len(text)                 # only a prefix was encoded
    for limit in (len(ids) - 1, len(ids), 10 * len(ids)):   # otherwise the whole text is encoded, as without
        assert tok.encode(text, limit=limit) == ids
    tok.backend = real
    long_text = text * 2                                # past LONG_TEXT: the GIL-free batch call, same ids
    assert len(long_text) >= 1 << 16 and tok.encode(long_text) == tok.backend.encode(long_text).ids
