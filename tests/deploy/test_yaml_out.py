"""The manifests' YAML writer: every string reads back verbatim, in ASCII, whatever characters it holds."""

import yaml

from edgecore.deploy.yaml_out import dump

TEXTS = ["rocket 🚀 and é\n", "x😀y", 'quote " and backslash \\ and \\ud83d typed out', "tab\tcr\r",
         "\x01\x7f\u2028\ufeff", "on", "yes", "1e3", ": x", "", "# not a comment"]


def test_strings_read_back_verbatim_and_the_output_is_ascii():
    for text in TEXTS:
        out = dump({"key": text, "list": [text, {"nested": text}]})
        assert out.isascii(), out
        assert yaml.safe_load(out) == {"key": text, "list": [text, {"nested": text}]}
    assert "\\U0001F680" in dump("🚀") and "\\ud83d" not in dump("🚀")     # YAML's escape, not a surrogate pair
