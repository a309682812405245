"""PrefillRequest's trailing `tenant`: carried to the core; a peer on either side without it still talks."""

import msgspec

from edgecore.protocol import messages as m


def test_the_tenant_is_the_last_field_and_older_peers_ignore_or_omit_it():
    req = m.PrefillRequest("r", [1, 2, 3], group="g", cache_salt="s", tenant="acme")
    fields = msgspec.msgpack.decode(m.encoder.encode(req))
    # after it only the LoRA adapter's name and fingerprint (test_prefill_request_adapter.py) and the trace context
    assert fields[-6:] == ["g", "s", "acme", "", "", ""] and m.decoder.decode(m.encoder.encode(req)) == req
    older = m.decoder.decode(msgspec.msgpack.encode(fields[:-4]))        # from an edge without the field
    assert older.tenant == "" and older.cache_salt == "s"

    class OldPrefillRequest(msgspec.Struct, array_like=True, tag=5, tag_field="t"):   # a core without it
        request_id: str
        token_ids: list[int]
    assert msgspec.msgpack.decode(m.encoder.encode(req), type=OldPrefillRequest).request_id == "r"
