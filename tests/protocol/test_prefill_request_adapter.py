"""PrefillRequest's trailing LoRA adapter and fingerprint (shared/lora.py): carried to the core; a peer on either
side without them still talks (an older edge's request is the base model's)."""

import msgspec

from edgecore.protocol import messages as m


def test_the_adapter_fields_are_last_and_optional():
    req = m.PrefillRequest("r", [1, 2, 3], tenant="acme", adapter="sql", adapter_fingerprint="0123456789abcdef")
    fields = msgspec.msgpack.decode(m.encoder.encode(req))
    assert fields[-3:] == ["acme", "sql", "0123456789abcdef"] and m.decoder.decode(m.encoder.encode(req)) == req
    older = m.decoder.decode(msgspec.msgpack.encode(fields[:-2]))        # from an edge without them: the base
    assert older.adapter == "" and older.adapter_fingerprint == "" and older.tenant == "acme"

    class OldPrefillRequest(msgspec.Struct, array_like=True, tag=5, tag_field="t"):   # a core without them
        request_id: str
        token_ids: list[int]
        sampling: list
        codecs: list[str]
        deadline_ms: int
        skip_tokens: int
        direct: bool
        core_decode: int
        edge_layers: int
        group: str
        cache_salt: str
        tenant: str
    assert msgspec.msgpack.decode(m.encoder.encode(req), type=OldPrefillRequest).tenant == "acme"
