"""Prefix caches scoped by a cache salt (vLLM's `cache_salt`): a prefix cached under one salt is no hit under
another (or none), the same salt hits, no salt behaves as before; the salt reaches the hash chain from every
path that looks the cache up (admission, `cached_prefix`, `reserve`, `submit_if_uncached_below`); the API key
file's `salt=` entries, the combination with a request's own salt, and the 400 for a bad `cache_salt`."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from aiohttp.test_utils import make_mocked_request

from edgecore.protocol import messages as m
from edgecore.shared.engine.engine_thread import EngineThread
from edgecore.shared.engine.handle import EngineRequest, OutputSink
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.errors import ConfigError
from edgecore.shared.kv.block_manager import BlockManager, BlockTable, prefix_hashes
from edgecore.shared.openai.http import KEY_SALT, ApiKeys, check_bearer, effective_cache_salt
from edgecore.shared.openai.request import ApiError, parse_chat, parse_completion
from edgecore.shared.node.secrets import MAX_CACHE_SALT, ApiKey, read_api_keys
from tests.conftest import make_engine

pytestmark = pytest.mark.timeout(120)

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
PROMPT = list(range(5, 5 + 50))       # three full blocks of 16, and the last token recomputed


# ---- block manager ---------------------------------------------------------------------------------
def test_the_salt_changes_every_hash_of_the_chain_and_none_is_the_unsalted_chain():
    tokens = list(range(40))
    plain, a, b = prefix_hashes(tokens, 8), prefix_hashes(tokens, 8, salt="a"), prefix_hashes(tokens, 8, salt="b")
    assert prefix_hashes(tokens, 8, salt=None) == plain
    assert len(plain) == len(a) == len(b) == 5
    assert not set(plain) & set(a) and not set(a) & set(b) and not set(plain) & set(b)
    assert prefix_hashes(tokens, 8, salt="") not in (plain, a)    # "" is a salt too (the engine never gets it)


def _register(bm: BlockManager, tokens: list[int], salt: str | None) -> BlockTable:
    table = BlockTable(salt=salt)
    bm.allocate_prompt(table, tokens, len(tokens))
    bm.register_full_blocks(table, tokens, len(tokens))
    return table


def test_blocks_are_reused_only_under_the_same_salt():
    bm = BlockManager(64, 4)
    tokens = list(range(17))
    table = _register(bm, tokens, "tenant-a")
    assert len(bm.match_prefix(tokens, "tenant-a")) == 4
    assert bm.match_prefix(tokens, "tenant-b") == [] and bm.match_prefix(tokens) == []
    bm.free_table(table)                          # released, still cached (evictable): the same rule holds
    assert len(bm.match_prefix(tokens, "tenant-a")) == 4 and bm.match_prefix(tokens) == []
    other = BlockTable(salt="tenant-b")
    assert bm.allocate_prompt(other, tokens, len(tokens)) == 0
    unsalted = _register(bm, tokens, None)        # no salt: today's behaviour, its own chain
    assert len(bm.match_prefix(tokens)) == 4 and set(bm.match_prefix(tokens)).isdisjoint(
        bm.match_prefix(tokens, "tenant-a"))
    bm.free_table(unsalted)


def test_a_preempted_sequence_keeps_its_salt():
    bm = BlockManager(64, 4)
    tokens = list(range(13))
    table = _register(bm, tokens, "s")
    bm.free_table(table)                          # what preemption does; the scheduler allocates again later
    assert table.salt == "s"
    assert bm.allocate_prompt(table, tokens, len(tokens)) == 12


# ---- engine ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    return make_engine(num_blocks=256)


def _run(engine, rid: str, prompt: list[int], salt: str | None, prefill_only: bool = False) -> int:
    """Run a request to its end; the prompt tokens it found cached."""
    seq = engine.add_request(rid, prompt, ONE, prefill_only=prefill_only, cache_salt=salt)
    while engine.has_unfinished():
        engine.step()
    return seq.num_cached_tokens


def test_engine_admission_is_scoped_by_the_salt(engine):
    prompt = [7] + PROMPT
    assert _run(engine, "a1", prompt, "a") == 0
    assert _run(engine, "b1", prompt, "b") == 0          # cached under "a": no hit under "b"
    assert _run(engine, "n1", prompt, None) == 0          # ... nor unsalted
    assert _run(engine, "a2", prompt, "a") == 48          # the same salt hits
    assert _run(engine, "n2", prompt, None) == 48         # no salt hits no salt, as before
    assert engine.cached_prefix(prompt, "a") == engine.cached_prefix(prompt) == 48
    assert engine.cached_prefix(prompt, "c") == 0


def test_reserve_measures_under_the_salt(engine):
    prompt = [8] + PROMPT
    assert _run(engine, "r0", prompt, "tenant") == 0
    _, cached = engine.reserve("r1", prompt, ONE, cache_salt="other")
    assert cached == 0
    engine.release("r1")
    _, cached = engine.reserve("r2", prompt, ONE, cache_salt="tenant")
    assert cached == 48
    engine.release("r2")


def test_pinned_contexts_are_unsalted(engine):
    prompt = [9] + PROMPT
    assert _run(engine, "ctx", prompt, None, prefill_only=True) == 0
    blocks = engine.pin_prefix("ctx")
    engine.release("ctx")
    try:
        assert engine.cached_prefix(prompt) == 48
        assert engine.cached_prefix(prompt, "tenant") == 0        # a salted request never reuses a context
    finally:
        engine.unpin(blocks)


async def test_async_engine_passes_the_salt_on_every_path():
    aengine = EngineThread(make_engine(num_blocks=128))
    aengine.start()
    try:
        prompt = [10] + PROMPT
        async for _ in aengine.generate(EngineRequest("first", prompt, ONE, cache_salt="x")):
            pass
        assert await aengine.cached_prefix(prompt, "x") == 48
        assert await aengine.cached_prefix(prompt) == 0
        queue: asyncio.Queue = asyncio.Queue()
        cached, added = await aengine.submit_if_uncached_below(EngineRequest("y", prompt, ONE, cache_salt="y"),
                                                               OutputSink.queue(queue), 10)
        assert (cached, added) == (0, False)
        cached, added = await aengine.submit_if_uncached_below(EngineRequest("x", prompt, ONE, cache_salt="x"),
                                                               OutputSink.queue(queue), 10)
        assert (cached, added) == (48, True)
        while not (await queue.get()).finished:
            pass
        assert await aengine.reserve(EngineRequest("rz", prompt, ONE, cache_salt="z"), None) == 0
        aengine.release("rz")
        assert await aengine.reserve(EngineRequest("rx", prompt, ONE, cache_salt="x"), None) == 48
        aengine.release("rx")
    finally:
        aengine.stop()


def test_the_prefill_request_carries_the_salt_after_the_group():
    salted = m.PrefillRequest("r", [1, 2, 3], group="g", cache_salt="acme\0s", tenant="acme")
    fields = msgspec.msgpack.decode(m.encoder.encode(salted))
    # later fields (LoRA adapter, trace context) follow: tests/protocol/test_prefill_request_*.py
    at = 1 + m.PrefillRequest.__struct_fields__.index("group")          # (the tag comes first)
    assert fields[at:at + 3] == ["g", "acme\0s", "acme"] and m.decoder.decode(m.encoder.encode(salted)) == salted
    older = m.decoder.decode(msgspec.msgpack.encode(fields[:at + 1]))   # what an edge without the fields sends
    assert older.cache_salt == "" and older.tenant == "" and older.group == "g"


# ---- API keys and the request's salt -------------------------------------------------------------------
def test_the_key_file_gives_keys_salts_and_plain_keys_keep_working(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# tenants\nsk-plain\n\nsk-acme salt=acme\n  sk-acme-2   salt=acme  \nsk with space\n"
                    "sk-beta salt=b=c\n")
    keys = read_api_keys(str(path))
    assert keys == [b"sk-plain", b"sk-acme", b"sk-acme-2", b"sk with space", b"sk-beta"]
    assert [k.salt for k in keys if isinstance(k, ApiKey)] == [None, "acme", "acme", None, "b=c"]
    assert "sk-acme" not in repr(keys)              # a key never shows in logs


@pytest.mark.parametrize("line", ["sk salt=", "sk salt=" + "x" * (MAX_CACHE_SALT + 1), "sk salt=a\0b"])
def test_a_bad_salt_in_the_key_file_is_a_config_error(tmp_path, line):
    path = tmp_path / "keys"
    path.write_text(f"ok\n{line}\n")
    with pytest.raises(ConfigError, match="line 2"):
        read_api_keys(str(path))


def test_a_key_with_two_salts_is_refused_and_the_environment_takes_salts(tmp_path, monkeypatch):
    path = tmp_path / "keys"
    path.write_text("sk salt=a\nsk salt=b\n")
    with pytest.raises(ConfigError, match="different salts"):
        read_api_keys(str(path))
    monkeypatch.setenv("EDGECORE_API_KEYS", "sk-1 salt=t1, sk-2")
    keys = read_api_keys(None)
    assert keys == [b"sk-1", b"sk-2"] and [k.salt for k in keys] == ["t1", None]


def _request(key: str | None = None):
    return make_mocked_request("POST", "/v1/completions", headers={"Authorization": f"Bearer {key}"} if key else {})


def test_the_effective_salt_combines_the_keys_with_the_requests_and_cannot_be_forged():
    keys = ApiKeys([ApiKey(b"sk-a", "acme"), ApiKey(b"sk-open"), b"sk-bytes"])
    assert keys.lookup(b"sk-a") == (True, "acme") and keys.lookup(b"sk-open") == (True, None)
    assert keys.lookup(b"sk-bytes") == (True, None) and keys.lookup(b"nope") == (False, None)
    seen = {}
    for key in ("sk-a", "sk-open", "sk-bytes"):
        req = _request(key)
        check_bearer(req, keys)
        for body_salt in (None, "acme", "x"):
            seen[key, body_salt] = effective_cache_salt(req, body_salt)
    assert _request("sk-a").get(KEY_SALT) is None            # only a checked request carries its key's salt
    assert seen["sk-open", None] is None and seen["sk-bytes", None] is None     # neither: unsalted, as before
    assert seen["sk-open", "x"] == seen["sk-bytes", "x"]      # unsalted keys share a request salt's scope
    salted = [seen["sk-a", s] for s in (None, "acme", "x")] + [seen["sk-open", s] for s in ("acme", "x")]
    assert len(set(salted)) == len(salted) and "acme" not in salted   # an unsalted key cannot name a tenant's
    with pytest.raises(ApiError) as exc:
        check_bearer(_request("nope"), keys)
    assert exc.value.status == 401


def test_cache_salt_is_parsed_on_both_endpoints(tokenizer):
    parsed = parse_completion({"prompt": "def f():", "max_tokens": 1, "cache_salt": "s1"}, tokenizer, 2048, 1024)
    assert parsed.cache_salt == "s1"
    assert parse_completion({"prompt": "x", "max_tokens": 1}, tokenizer, 2048, 1024).cache_salt is None
    assert parse_completion({"prompt": "x", "max_tokens": 1, "cache_salt": None}, tokenizer, 2048, 1024
                            ).cache_salt is None
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "cache_salt": "s2"}, tokenizer, 2048, 1024)
    assert chat.cache_salt == "s2"


@pytest.mark.parametrize("salt", ["", 7, ["a"], "x" * (MAX_CACHE_SALT + 1)])
def test_a_bad_cache_salt_is_a_400_naming_it(tokenizer, salt):
    for parse, body in ((parse_completion, {"prompt": "x", "max_tokens": 1}),
                        (parse_chat, {"messages": [{"role": "user", "content": "hi"}]})):
        with pytest.raises(ApiError) as exc:
            parse({**body, "cache_salt": salt}, tokenizer, 2048, 1024)
        assert exc.value.status == 400 and exc.value.param == "cache_salt"
        assert exc.value.code in ("invalid_value", "invalid_type")
