"""PrefillRequest's trailing `traceparent` (shared/node/tracing.py): carried to the core when the edge traces, absent
as "" (one byte) when it does not, ignored by a core of an earlier release."""

import msgspec

from edgecore.protocol import messages as m

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_the_traceparent_is_last_optional_and_ignored_by_older_cores():
    req = m.PrefillRequest("r", [1, 2, 3], adapter="sql", adapter_fingerprint="0123456789abcdef", traceparent=TP)
    fields = msgspec.msgpack.decode(m.encoder.encode(req))
    assert fields[-1] == TP and m.decoder.decode(m.encoder.encode(req)) == req
    untraced = m.PrefillRequest("r", [1, 2, 3], adapter="sql", adapter_fingerprint="0123456789abcdef")
    assert msgspec.msgpack.decode(m.encoder.encode(untraced))[-1] == ""                    # off: one byte
    older = m.decoder.decode(msgspec.msgpack.encode(fields[:-1]))         # from an edge that does not trace
    assert older.traceparent == "" and older.adapter == "sql"

    fields_before = [(name, object) for name in m.PrefillRequest.__struct_fields__[:-1]]     # a core before it
    CoreBeforeTraces = msgspec.defstruct("CoreBeforeTraces", fields_before, array_like=True, tag=5, tag_field="t")
    seen = msgspec.msgpack.decode(m.encoder.encode(req), type=CoreBeforeTraces)
    assert seen.adapter_fingerprint == "0123456789abcdef"                  # the rest of the request is intact
