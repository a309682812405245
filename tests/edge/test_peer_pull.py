"""KV pulled from a peer edge (edge/peer_pull.py, edge/peer_server.py): two edges of the bundled model in this
process, A serving its cached KV, B pulling it. The pulled prefix gives B the tokens A would give; a peer that
goes away mid-pull costs B nothing but the pull; the link checks that a peer presents an edge credential."""

import asyncio

import pytest

from edgecore.edge.node import EdgeConfig, EdgeNode
from edgecore.edge import peer_server
from edgecore.protocol import messages as m
from edgecore.protocol.state import Connection, LocalProtocolError, Role
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.models.config import CacheConfig

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]

SECRET = b"peer-pull-test-secret-0123456789"
PROMPT = [(i * 37) % 500 + 3 for i in range(300)]      # 300 tokens: 18 whole blocks of 16 beyond the last token
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def _config(model_dir, **kw) -> EdgeConfig:
    return EdgeConfig(model_dir=str(model_dir), secret=SECRET, cache=CacheConfig(block_size=16, num_blocks=256),
                      **kw)


async def _generate(edge: EdgeNode, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    """(output tokens, prompt tokens cached at admission)."""
    tokens, cached = [], 0
    async for out in edge.generate(rid, prompt, GREEDY):
        tokens += out.new_token_ids
        cached = max(cached, out.num_cached_tokens or 0)
    return tokens, cached


async def _announced(edge: EdgeNode, prompt: list[int], tokens: int) -> None:
    """Wait until B's connection to A says A holds `tokens` of the prompt (its digest arrived)."""
    from edgecore.edge.core_cache import PromptHashes
    client = edge.peer_pull.router.clients[0]
    for _ in range(200):
        if client.healthy and client.cache.cached_tokens(PromptHashes(prompt, None)) >= tokens:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the peer's digest never announced the prompt")


def _count(edge: EdgeNode, outcome: str) -> float:
    return edge.metrics.peer_pulls.labels(outcome)._value.get()


@pytest.fixture
async def pair(model_dir):
    a = EdgeNode(_config(model_dir, peer_listen=("127.0.0.1", 0), name="edge-a"))
    await a.start()
    assert a.peer_server is not None
    b = EdgeNode(_config(model_dir, peers=[("127.0.0.1", a.peer_server.port)], name="edge-b"))
    await b.start()
    try:
        yield a, b
    finally:
        await b.stop()
        await a.stop()


async def test_a_prompt_cached_at_a_peer_is_pulled_and_gives_the_same_tokens(pair):
    a, b = pair
    reference, _ = await _generate(a, "a1", PROMPT)             # A computes and caches the prompt
    await _announced(b, PROMPT, 288)
    tokens, cached = await _generate(b, "b1", PROMPT)
    assert tokens == reference
    assert _count(b, "pulled") == 1 and b.metrics.peer_pull_tokens._value.get() == 288
    assert cached == 288                                        # reported as cached: B computed only the rest
    assert a.metrics.peer_served_blocks._value.get() == 18
    [peer] = b.stats()["peers"]
    assert peer["healthy"] and peer["announced_blocks"] >= 18 and a.stats()["peer_sessions"] == 1
    # A second request of the same prefix finds it in B's own pool: no second pull.
    longer = PROMPT + [7, 8, 9]
    again, cached = await _generate(b, "b2", longer)
    assert _count(b, "pulled") == 1 and cached == 288
    assert again == (await _generate(a, "a2", longer))[0]


async def test_a_peer_that_goes_away_mid_pull_costs_only_the_pull(pair, monkeypatch):
    a, b = pair
    reference, _ = await _generate(a, "a1", PROMPT)
    await _announced(b, PROMPT, 288)
    monkeypatch.setattr(peer_server, "PULL_WINDOW_BYTES", 1)     # one block per engine call
    calls = 0
    real = a.handle.pool_blocks

    async def dies_after_two(hashes, max_bytes):
        nonlocal calls
        calls += 1
        if calls > 2:                                           # the peer's node goes down mid-pull
            for session in list(a.peer_server.sessions):
                session.peer._abort(hard=True)
            await asyncio.sleep(3600)
        return await real(hashes, max_bytes)
    monkeypatch.setattr(a.handle, "pool_blocks", dies_after_two)
    tokens, cached = await _generate(b, "b1", PROMPT)
    assert tokens == reference                                  # no error, the same tokens
    assert _count(b, "partial") == 1 and b.metrics.peer_pull_tokens._value.get() == 32
    assert cached == 32                                         # the two blocks that arrived were used


async def test_a_prediction_against_the_pull_computes_instead(pair):
    a, b = pair
    await _generate(a, "a1", PROMPT)
    await _announced(b, PROMPT, 288)
    b.peer_pull.router.clients[0].bandwidth = 1000.0            # 1 kB/s: the KV would take minutes
    await _generate(b, "b1", PROMPT)
    assert _count(b, "slower") == 1 and _count(b, "pulled") == 0


def test_block_pulls_go_only_to_a_server_that_lists_the_capability():
    conn = Connection(Role.CLIENT, SECRET, "fp", ["lossless"])
    conn.peer_capabilities = list(m.CAPABILITIES)               # a core: no "block-pull"
    with pytest.raises(LocalProtocolError):
        conn._send(m.BlockPull("r", 16, b"\0" * 8))


async def test_a_prefill_request_to_a_peer_port_is_refused_for_that_request(pair):
    """An edge whose --core names a peer port by mistake: its request gets an Error (it fails over), the connection
    stays up, and a bad BlockPull is refused the same way."""
    from edgecore.protocol.transport import connect
    a, _ = pair
    peer = await connect("127.0.0.1", a.peer_server.port, secret=SECRET, fingerprint=a.fingerprint,
                         codecs=["lossless"])
    try:
        await peer.send(m.PrefillRequest("r1", [1, 2, 3]))
        reply = await peer.recv(timeout=10)
        assert isinstance(reply, m.Error) and reply.request_id == "r1" and "prefills nothing" in reply.message
        await peer.send(m.BlockPull("p1", 8, b"\0" * 8))             # another block size
        reply = await peer.recv(timeout=10)
        while isinstance(reply, m.CacheDigest):
            reply = await peer.recv(timeout=10)
        assert isinstance(reply, m.Error) and reply.request_id == "p1" and "block size 8" in reply.message
    finally:
        await peer.close()
