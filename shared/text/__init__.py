"""Text: the tokenizer (HF `tokenizer.json` or a GGUF file's vocabulary) and token ↔ byte maps for grammars."""
