"""HTTPS on the edge's OpenAI endpoint: the official `openai` client (through an httpx client that trusts
the local CA) completes and chats over TLS; plain HTTP and an untrusting client are refused; a renewed
certificate is served to new connections without a restart. An in-process server over a real engine."""

from __future__ import annotations

import asyncio
import socket
import ssl

import httpx2 as httpx
import openai
import pytest
from cryptography import x509

from edgecore.deploy.certs import LocalCA
from edgecore.edge.http import EdgeHTTP, start_http
from edgecore.shared.node.tls import ServerTLS
from tests.conftest import make_engine
from tests.edge.test_http_hardening import EngineEdge

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def https_edge(tmp_path):
    ca = LocalCA.create(tmp_path / "ca")
    cert, key = ca.issue("edge", ["127.0.0.1", "localhost"], tmp_path)
    tls = ServerTLS(cert, key, interval=0.05)
    runner, port = await start_http(EdgeHTTP(EngineEdge(make_engine(num_blocks=64)), "pydoc-llama"),
                                    "127.0.0.1", 0, tls)
    yield {"ca": ca, "port": port, "tls": tls, "tmp": tmp_path}
    await runner.cleanup()


def served_serial(port: int, ca_file: str) -> int:
    ctx = ssl.create_default_context(cafile=ca_file)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            der = s.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


async def test_the_openai_client_works_over_https(https_edge):
    port, ca = https_edge["port"], https_edge["ca"]
    async with httpx.AsyncClient(verify=ca.ca_file) as http:
        client = openai.AsyncOpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key="unused", http_client=http)
        done = await client.completions.create(model="pydoc-llama", prompt="The for statement", max_tokens=5,
                                               temperature=0)
        assert done.choices[0].text and done.usage.completion_tokens == 5
        chat = await client.chat.completions.create(model="pydoc-llama", max_tokens=4, temperature=0,
                                                    messages=[{"role": "user", "content": "Hello"}])
        assert chat.choices[0].message.content
    async with httpx.AsyncClient() as untrusting:            # the system's CAs do not know the local CA
        with pytest.raises(httpx.ConnectError):
            await untrusting.get(f"https://127.0.0.1:{port}/health")
    async with httpx.AsyncClient() as plain:                 # plain HTTP on the HTTPS port gets no answer
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError)):
            await plain.get(f"http://127.0.0.1:{port}/health")


async def test_a_renewed_certificate_is_served_without_a_restart(https_edge):
    port, ca, tls = https_edge["port"], https_edge["ca"], https_edge["tls"]
    before = await asyncio.to_thread(served_serial, port, ca.ca_file)
    ca.issue("edge", ["127.0.0.1"], https_edge["tmp"])       # the same files, a new certificate
    for _ in range(100):
        if tls.reloads:
            break
        await asyncio.sleep(0.05)
    after = await asyncio.to_thread(served_serial, port, ca.ca_file)
    assert tls.reloads == 1 and after != before
