"""Each token's raw bytes (OpenAI's logprobs `bytes`): joined, the tokens of a text give its UTF-8 bytes, also
where one character spans several tokens (their decoded text alone is U+FFFD)."""

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

from edgecore.shared.openai.response import TokenText
from edgecore.shared.engine.output import TokenLogprob
from edgecore.shared.text.token_bytes import TokenBytes
from edgecore.shared.text.tokenizer import Tokenizer

TEXTS = ["The for statement", "é😀 ünïcode — 日本語", "  two spaces\nand a newline"]


def test_byte_level_tokens_join_to_the_texts_bytes(tokenizer):
    of = TokenBytes(tokenizer).of
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(of(i) for i in ids) == text.encode()
    assert any(tokenizer.decode([i]) == "\ufffd" for i in tokenizer.encode("😀", add_special_tokens=False))


def test_sentencepiece_byte_fallback_tokens_join_to_the_texts_bytes():
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for c in "▁abcdefghijklmnopqrstuvwxyz":
        vocab[c] = len(vocab)
    vocab["▁a"] = len(vocab)
    hf = HFTokenizer(models.BPE(vocab, [("▁", "a")], unk_token="<unk>", byte_fallback=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tok = Tokenizer(hf, {})
    of = TokenBytes(tok).of
    text = "a cat é😀 ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert "<0xC3>" in [hf.id_to_token(i) for i in ids]
    assert b"".join(of(i) for i in ids) == (" " + text).encode()      # the prepended ▁ is a space
    lone = [TokenLogprob(vocab["<0x80>"], -1.0, []), TokenLogprob(vocab["a"], -1.0, [])]   # invalid UTF-8
    assert TokenText(tok).completion_logprobs(lone)["text_offset"] == [0, 1]     # U+FFFD, then "a"


def test_logprobs_carry_the_bytes_and_offsets_of_split_characters(tokenizer):
    texts = TokenText(tokenizer)
    ids = tokenizer.encode("aé😀b", add_special_tokens=False)
    lps = [TokenLogprob(i, -1.0, [(i, -1.0)]) for i in ids]
    chat = texts.chat_logprobs(lps)["content"]
    assert bytes(b for entry in chat for b in entry["bytes"]) == "aé😀b".encode()
    offsets = texts.completion_logprobs(lps)["text_offset"]
    assert offsets[0] == 0 and offsets[-1] == len("aé😀") and offsets == sorted(offsets)
