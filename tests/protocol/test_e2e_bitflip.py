"""Real edge and core processes, with a relay between them that flips bits as a faulty link would: in
sealed frames' encrypted message headers (PrefillDone.first_token among them: the field that once gave wrong
completions silently) and in their KV payloads. Every request must still return single-node output (the edge
retries the one request whose frame was rejected) and nothing may leak on either side."""

import concurrent.futures
import random

import pytest

from edgecore.deploy.fault_relay import Fault, FaultRelay, RelayThread
from edgecore.protocol.framing import FIXED_SIZE, SEALED, TAG_SIZE
from edgecore.shared.engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.e2e.procs import get_json, post_json, start_core, start_edge, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class Faults:
    """The relay's plan. Frames are sealed, so their types are hidden: it corrupts every third sealed frame
    going down after the handshake (the first is AuthOk), a bit of its encrypted message header when it has no
    payload (a PrefillDone, a Token), else a bit near the end of its payload (a KV chunk). It never corrupts
    two frames in a row in one direction: that is indistinguishable from a drop or reorder, and by design fails
    the connection (docs/wire-format.md §4)."""

    def __init__(self):
        self.rng = random.Random(23)
        self.last_flipped = False
        self.kinds: list[str] = []

    def __call__(self, direction, ftype, n, frame):
        if direction != "down" or ftype != SEALED or n < 2:
            return None
        fault = self._choose(n, frame) if n % 3 == 0 and not self.last_flipped else None
        self.last_flipped = fault is not None
        return fault

    def _choose(self, n, frame):
        hlen = int.from_bytes(frame[8:12], "little")
        payload = len(frame) - TAG_SIZE - FIXED_SIZE - hlen
        if payload <= 64:
            self.kinds.append("header")
            return Fault("flip_message", "down", SEALED, 0, self.rng.randrange(hlen * 8))
        self.kinds.append("payload")
        return Fault("flip_payload", "down", SEALED, 0, self.rng.randrange((payload - 64) * 8, payload * 8))


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("secrets") / "cluster.secret"
    path.write_text("bitflip-cluster-secret\n")
    return str(path)


@pytest.fixture(scope="module")
def faulty_cluster(secret_file):
    core, port, core_http = start_core(secret_file)
    faults = Faults()
    relay = RelayThread(FaultRelay(("127.0.0.1", port), plan=faults))
    relay_port = relay.start()
    edge, http = start_edge("--local-prefill-below", "0", cores=[relay_port], secret_file=secret_file)
    yield {"core_http": core_http, "http": http, "relay": relay.relay, "edge": edge, "faults": faults}
    edge.stop()
    relay.stop()
    core.stop()


def test_bit_flips_on_the_wire_never_change_an_answer(faulty_cluster, tokenizer, heldout):
    ids = tokenizer.encode(heldout)
    prompts = [ids[i * 50: i * 50 + n] for i, n in enumerate([7, 19, 33, 64, 90, 120, 150, 200])]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ref = make_engine().generate(prompts, params)
    http = faulty_cluster["http"]

    def complete(prompt):
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        return post_json(f"http://127.0.0.1:{http}/v1/completions", body)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(complete, prompts))
    for p, r, o in zip(prompts, ref, outs):
        assert o["choices"][0]["text"] == r["text"], f"prompt of {len(p)} tokens"
    # The flips were exercised, in message headers and in KV payloads.
    kinds = faulty_cluster["faults"].kinds
    assert "header" in kinds and "payload" in kinds, kinds
    # Each corrupted frame failed only its request (then retried), never the connection.
    logs = faulty_cluster["edge"].logs()
    assert logs.count("was corrupted in transit") >= 3 and "in a row failed their MAC" not in logs
    # Nothing leaked: the edge's blocks and the core's leases and blocks all return to zero.
    assert wait_for(lambda: get_json(f"http://127.0.0.1:{http}/stats")["blocks_used"] == 0)
    core = wait_for(lambda: (s := get_json(f"http://127.0.0.1:{faulty_cluster['core_http']}/stats"))["leases"] == 0
                    and s["remote_requests"] == 0 and s)
    assert core and core["blocks_used"] == 0
