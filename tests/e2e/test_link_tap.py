"""A passive tap on the core↔edge link: a relay records both directions while disaggregated requests (the edge
waits for the KV) and decode-handover requests (the core streams tokens first) run between real processes;
the capture must hold no prompt token ids, no sampled tokens, no request ids, no model or node names and no
readable text. A positive control shows each search finds its target in the plaintext encoding of the same
messages, so an empty result means sealed frames, not a blind search."""

import socket
import threading

import msgspec
import pytest

from edgecore.protocol import messages as m
from edgecore.shared.engine.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.e2e.procs import get_json, post_json, start_core, start_edge

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PROMPT = ("The quarterly reconciliation of the Hildebrandt account showed that the pelican shipment "
          "was misrouted through Valparaiso before the auditors noticed the discrepancy in the ledger")


class TapRelay:
    """A TCP relay that forwards every connection to `target` and records each direction's bytes."""

    def __init__(self, target: int):
        self.target = target
        self.captured = {"up": bytearray(), "down": bytearray()}
        self.lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for src, dst, name in ((client, upstream, "up"), (upstream, client, "down")):
                threading.Thread(target=self._pump, args=(src, dst, name), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, name: str) -> None:
        try:
            while data := src.recv(1 << 16):
                with self.lock:
                    self.captured[name] += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def capture(self) -> bytes:
        with self.lock:
            return bytes(self.captured["up"]) + b"\0" + bytes(self.captured["down"])

    def close(self) -> None:
        self.server.close()


def secrets_in(capture: bytes, needles: dict[str, list[bytes]]) -> dict[str, list[bytes]]:
    return {what: [n for n in found if n in capture] for what, found in needles.items() if any(n in capture
                                                                                              for n in found)}


def needles_for(prompt_ids, outputs, request_ids, names, texts) -> dict[str, list[bytes]]:
    enc = msgspec.msgpack.encode
    return {
        # the prompt as a PrefillRequest carries it, and any 6 consecutive ids as msgpack integers
        "prompt token ids": [enc(prompt_ids)] + [b"".join(enc(t) for t in prompt_ids[i:i + 6])
                                                 for i in range(0, len(prompt_ids) - 6, 3)],
        # a sampled token as PrefillDone / Token frames carry it: after its request id, position then token
        "sampled tokens": [enc(rid) + enc(p) + enc(t) for rid in request_ids for out in outputs
                           for p, t in enumerate(out[:8], start=1)],
        "request ids": [rid.encode() for rid in request_ids],
        "model and node names": [n.encode() for n in names],
        "readable text": [w.encode() for t in texts for w in t.split() if len(w) >= 8],
    }


@pytest.fixture(scope="module")
def tapped(tmp_path_factory):
    secret = tmp_path_factory.mktemp("tap") / "cluster.secret"
    secret.write_text("tap-test-cluster-secret\n")
    core, port, core_http = start_core(str(secret), "--name", "core-tap-3f9e1c")
    relay = TapRelay(port)
    handover, handover_http = start_edge("--local-prefill-below", "0", "--name", "edge-tap-a71b",
                                         cores=[relay.port], secret_file=str(secret))
    waits, waits_http = start_edge("--local-prefill-below", "0", "--handover-max-tokens", "0", "--name",
                                   "edge-tap-c05d", cores=[relay.port], secret_file=str(secret))
    yield {"relay": relay, "core_http": core_http, "edges": [handover_http, waits_http]}
    for node in (handover, waits, core):
        node.stop()
    relay.close()


def test_a_passive_tap_reads_nothing_of_the_requests(tapped, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    [ref] = make_engine().generate([prompt_ids], params)
    request_ids, texts = [], [PROMPT]
    for http in tapped["edges"]:
        out = post_json(f"http://127.0.0.1:{http}/v1/completions",
                        {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert out["choices"][0]["text"] == ref["text"]          # served through the core, correctly
        request_ids.append(out["id"] + "-0")                     # the id the edge gives the core
        texts.append(out["choices"][0]["text"])
    stats = get_json(f"http://127.0.0.1:{tapped['edges'][0]}/stats")
    assert stats["handover"]["handovers"] >= 1, stats["handover"]        # one request did go through a handover
    core = get_json(f"http://127.0.0.1:{tapped['core_http']}/stats")
    names = [core["model_fingerprint"], "core-tap-3f9e1c", "edge-tap-a71b", "edge-tap-c05d"]
    needles = needles_for(prompt_ids, [ref["token_ids"]], request_ids, names, texts)

    capture = tapped["relay"].capture()
    assert len(capture) > 50_000                                  # the KV crossed the tap
    assert secrets_in(capture, needles) == {}

    # Positive control: the same searches find every kind of secret in the plaintext encoding of the messages.
    plain = b"".join(m.encoder.encode(msg) for msg in (
        m.PrefillRequest(request_ids[0], prompt_ids), m.Auth(core["model_fingerprint"], ["lossless"], [],
                                                              "edge-tap-a71b"),
        *[m.Token(request_ids[0], p, t) for p, t in enumerate(ref["token_ids"][:8], start=1)])) + PROMPT.encode()
    assert set(secrets_in(plain, needles)) == set(needles)
