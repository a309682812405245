"""PrefillRequest's trailing LoRA adapter and fingerprint (shared/models/lora.py): carried to the core; an older edge's
request (without them) is the base model's. An older core would silently drop them (msgspec ignores unknown
trailing fields) and prefill with the base model, so they stand behind the "lora" capability: a core advertises it
in AuthOk and an edge sends an adapter only to a core that does (tests/edge/test_lora_placement.py)."""

import msgspec

from edgecore.protocol import messages as m


def test_the_adapter_fields_are_trailing_and_optional():
    req = m.PrefillRequest("r", [1, 2, 3], tenant="acme", adapter="sql", adapter_fingerprint="0123456789abcdef")
    fields = msgspec.msgpack.decode(m.encoder.encode(req))
    at = fields.index("acme")             # then the adapter's fields (and, since, the trace context)
    assert fields[at:at + 3] == ["acme", "sql", "0123456789abcdef"] and m.decoder.decode(m.encoder.encode(req)) == req
    older = m.decoder.decode(msgspec.msgpack.encode(fields[:at + 1]))   # from an edge without them: the base
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
    dropped = msgspec.msgpack.decode(m.encoder.encode(req), type=OldPrefillRequest)
    assert dropped.tenant == "acme" and not hasattr(dropped, "adapter")     # the adapter would be lost there


def test_cores_advertise_the_lora_capability():
    """The capability that guards the fields: in the AuthOk every core of this release sends, and the edge's side
    of the connection records it (protocol/state.py); an older core's AuthOk lacks it."""
    from tests.protocol.pairs import handshake, new_pair
    assert m.LORA_ADAPTERS == "lora" and m.LORA_ADAPTERS in m.CAPABILITIES
    edge, core = new_pair()
    handshake(edge, core)
    assert m.LORA_ADAPTERS in edge.peer_capabilities
    edge, core = new_pair()
    core.capabilities = [m.COMPACT_KV_PARAMS]                                   # a core before LoRA
    handshake(edge, core)
    assert m.LORA_ADAPTERS not in edge.peer_capabilities
