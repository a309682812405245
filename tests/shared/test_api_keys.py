"""API keys are held as SHA-256 digests in a set: a check hashes the presented key once, whatever the number of
configured keys (O(1) in their number, constant time in the presented key's content)."""

import hashlib
import secrets

from edgecore.shared.openai.http import ApiKeys


def test_one_hundred_thousand_keys_cost_one_hash_per_check(monkeypatch):
    keys = [f"sk-{i:06d}-{secrets.token_hex(8)}".encode() for i in range(100_000)]
    ring = ApiKeys(keys)
    assert len(ring) == 100_000 and ring
    calls = 0
    real = hashlib.sha256

    def counting(data: bytes = b""):
        nonlocal calls
        calls += 1
        return real(data)
    monkeypatch.setattr(hashlib, "sha256", counting)
    probes = keys[::997] + [k[:-1] + b"x" for k in keys[::4999]] + [b"", b"sk-", b"\x00" * 64]
    accepted = [ring.accepts(k) for k in probes]
    assert calls == len(probes)
    assert accepted == [True] * len(keys[::997]) + [False] * (len(probes) - len(keys[::997]))


def test_no_keys_means_no_check_and_keys_are_not_kept_in_clear():
    assert not ApiKeys([])
    ring = ApiKeys([b"sk-secret"])
    assert ring.accepts(b"sk-secret") and not ring.accepts(b"sk-secreT")
    assert b"sk-secret" not in repr(vars(ring)).encode()
