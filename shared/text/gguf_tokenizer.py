"""The tokenizer of a GGUF file: a `tokenizer.json` beside the file, or one built from the file's metadata.

Life cycle: `tokenizer_for_gguf(path)` (what `Tokenizer.from_dir` calls for a `.gguf` path) takes the
`tokenizer.json` (and `tokenizer_config.json`) in the file's directory when its vocabulary has as many
tokens as the file's, and otherwise builds a `tokenizers` tokenizer from the metadata:
- `tokenizer.ggml.model` "gpt2": byte-level BPE from `tokens` and `merges`; the pre-tokenizer's split pattern
  by `tokenizer.ggml.pre` (GPT-2's, Llama 3's or Qwen2's; another name gets GPT-2's, with a warning);
- "llama": SentencePiece BPE with byte fallback, its merges derived from `scores` (a merge ranks as the
  score of the token it makes, highest first), "▁" for spaces and one prepended;
control tokens (token type 3) and user-defined ones (4) become added tokens (control ones special), BOS is
prepended when `tokenizer.ggml.add_bos_token` says so (default: yes for "llama", no for "gpt2"), and
`tokenizer.chat_template` becomes the chat template. The log says which source was used.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from edgecore.shared.errors import ConfigError, ModelLoadError

log = logging.getLogger("edgecore.models")

_SPLIT = {
    "gpt2": None,     # the byte-level pre-tokenizer's own (GPT-2) pattern
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_PRE = {"default": "gpt2", "gpt2": "gpt2", "llama-bpe": "llama3", "llama3": "llama3", "qwen2": "qwen2"}
CONTROL, USER_DEFINED = 3, 4


def gguf_has_tokenizer(path: str | Path) -> bool:
    """Whether `path` is a GGUF file with a tokenizer: in its metadata or a tokenizer.json beside it."""
    if not str(path).endswith(".gguf"):
        return False
    if (Path(path).parent / "tokenizer.json").is_file():
        return True
    from edgecore.shared.models.gguf_file import GGUFFile
    try:
        return bool(GGUFFile(path).meta.get("tokenizer.ggml.tokens"))
    except ModelLoadError:
        return False            # the model's own load says what is wrong with the file


def tokenizer_for_gguf(path: str | Path) -> Any:
    """A `Tokenizer` (shared/text/tokenizer.py) for the GGUF file at `path`."""
    from edgecore.shared.models.gguf_file import GGUFFile
    from edgecore.shared.text.tokenizer import Tokenizer
    path = Path(path)
    try:
        meta = GGUFFile(path).meta
    except ModelLoadError as exc:
        raise ConfigError(str(exc)) from None
    tokens = meta.get("tokenizer.ggml.tokens")
    beside = path.parent / "tokenizer.json"
    if beside.is_file():
        tok = Tokenizer.from_dir(path.parent)
        if not tokens or tok.vocab_size == len(tokens):
            log.info("%s: tokenizer from %s", path, beside)
            return tok
        log.warning("%s: %s has %d tokens, the file %d: using the file's own tokenizer", path, beside,
                    tok.vocab_size, len(tokens))
    if not tokens:
        raise ConfigError(f"{path}: the file has no tokenizer (tokenizer.ggml.tokens) and no tokenizer.json "
                          "is beside it")
    kind = meta.get("tokenizer.ggml.model")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges") or [], str(meta.get("tokenizer.ggml.pre",
                                                                                               "default")), path)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        backend = _sentencepiece_bpe(tokens, scores, types, meta.get("tokenizer.ggml.unknown_token_id"))
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    else:
        raise ConfigError(f"{path}: tokenizer.ggml.model '{kind}' is not supported (gpt2 or llama)")
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == USER_DEFINED])
    config: dict[str, Any] = {"chat_template": meta.get("tokenizer.chat_template")}
    for key, name in (("bos_token", "bos"), ("eos_token", "eos")):
        index = meta.get(f"tokenizer.ggml.{name}_token_id")
        if index is not None and 0 <= int(index) < len(tokens):
            config[key] = tokens[int(index)]
    if add_bos and "bos_token" in config:
        bos = config["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    log.info("%s: tokenizer from the file's metadata (%s, %d tokens)", path, kind, len(tokens))
    return Tokenizer(backend, config)


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str, path: Path) -> _HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = _HFTokenizer(models.BPE(vocab, pairs, fuse_unk=False))       # type: ignore[arg-type]
    split = _PRE.get(pre)
    if split is None:
        log.warning("%s: tokenizer.ggml.pre '%s' is not known here: GPT-2's split pattern is used", path, pre)
        split = "gpt2"
    pattern = _SPLIT[split]
    if pattern is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int], unk: int | None) -> _HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, str, str]] = []
    for t, score, kind in zip(tokens, scores, types):
        if kind != 1:             # only normal pieces are made by merging
            continue
        for i in range(1, len(t)):
            a, b = t[:i], t[i:]
            if a in vocab and b in vocab:
                ranked.append((-float(score), vocab[t], a, b))
    ranked.sort()
    merges = [(a, b) for _, _, a, b in ranked]
    unk_token = tokens[int(unk)] if unk is not None and 0 <= int(unk) < len(tokens) else None
    backend = _HFTokenizer(models.BPE(vocab, merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return backend


def tokenizer_metadata(tokenizer_json: str | Path) -> dict[str, Any]:
    """The GGUF tokenizer keys of a byte-level BPE `tokenizer.json` (tests and tools writing GGUF files)."""
    data = json.loads(Path(tokenizer_json).read_text())
    model = data["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    for added in data.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in data.get("added_tokens", []) if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return {"tokens": tokens, "merges": merges, "types": [CONTROL if t in special else 1 for t in tokens]}
