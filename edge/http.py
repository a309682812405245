"""The edge's OpenAI-compatible HTTP endpoint (aiohttp).

Life cycle of a request: the connection is admitted under the server's
limits (`shared/node/http_server.py`: connection cap, header and body timeouts) →
middleware checks the API key (constant-time) on /v1/ and /stats and turns
every failure, our own bugs included, into a counted OpenAI error object → the
handler reads the body (size-limited: 413), decodes JSON (400), validates
fields (400/404), checks the request's sequences (prompts × n ≤
`max_seqs_per_request`: 400), its tenant's terms (with a tenants file: the key's tenant,
its models — 404 — and limits: requests and tokens per minute, sequences in flight — 429 with
Retry-After, nothing charged —; shared/node/tenants.py) and capacity (sequences in flight ≤
`max_concurrent`: 503), then charges the tenant → its prefix-cache scope (the API key's salt combined with
the body's `cache_salt`: `effective_cache_salt`) → one engine stream per choice (prompts × n), merged → either
one JSON response, or SSE chunks as tokens decode (role first, deltas — with
tools, text that may open a tool call is held and the calls sent as
`tool_calls` deltas at the end — finish_reason, optional usage chunk (with vLLM's
`continuous_usage_stats` every chunk also carries its choice's usage so far),
`data: [DONE]`). A client that
disconnects cancels the handler, which aborts every choice and frees its KV
at the edge and the core.

Drain (`start_drain`, the edge's SIGTERM): /ready turns 503 at once, every new generation or context request
gets a 503 (`server_shutting_down`), and so does every request still waiting for its first output (queued or
prefilling: nothing of it was sent); `drained()` returns once the requests being served (streams included) have
finished; the node then stops (edge/cli.py, shared/node/service.py).

LoRA adapters (shared/models/lora.py): `model` may name a served adapter (`--lora`, or loaded with vLLM's
`POST /v1/load_lora_adapter`, which with `POST /v1/unload_lora_adapter` needs the admin key,
`--admin-key-file`, and is a 404 without one); /v1/models lists them with the base model as `parent`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from edgecore.edge.drain import Drain
from edgecore.edge.metrics import TenantMetrics
from edgecore.edge.service import EdgeService
from edgecore.shared.engine.output import RequestOutput
from edgecore.shared.errors import EngineDead, RequestError
from edgecore.shared.node.admin_key import AdminKey
from edgecore.shared.node.http_server import ServerLimits, start_site
from edgecore.shared.errors import AdapterError
from edgecore.shared.openai.extra_routes import adapter_cards, add_edge_routes, model_card
from edgecore.shared.openai.http import TENANT, effective_cache_salt, error_middleware, json_body, off_loop
from edgecore.shared.openai.request import ApiError, ParsedRequest, check_model, parse_chat, parse_completion
from edgecore.shared.openai.response import ChoiceResult, TokenText, response_body, usage, usage_so_far
from edgecore.shared.node.tenants import BAND_SPAN, Grant, RateLimited, TenantRegistry
from edgecore.shared.node.tls import ServerTLS
from edgecore.shared.text.tokenizer import TextTooLong
from edgecore.shared.node.tracing import parse_traceparent, tracer

log = logging.getLogger("edgecore.http")
json_encode = msgspec.json.Encoder().encode
T = TypeVar("T")
GRANT = web.RequestKey("edgecore_grant", Grant)              # the tenant's charge for the request being served
ENGINE_TERMS = web.RequestKey("edgecore_engine_terms", dict)  # tenant, weight, priority for EdgeService.generate


class EdgeHTTP:
    def __init__(self, edge: EdgeService, served_model: str, api_keys: Sequence[bytes] | None = None,
                 max_body: int = 8 * 1024 * 1024, max_concurrent: int = 256, max_seqs_per_request: int = 64,
                 limits: ServerLimits | None = None, tenants: TenantRegistry | None = None,
                 admin_key: AdminKey | None = None):
        self.edge = edge
        self.admin_key = admin_key                      # None: no adapter loading at run time (the routes 404)
        self.tenants = tenants                          # shared/node/tenants.py; None: the API keys alone, no limits
        self.tenant_metrics = TenantMetrics(served_model)
        if tenants is not None:
            tenants.on_change = lambda: self.tenant_metrics.keep(tenants.names)
        self.served_model = served_model
        self.api_keys = list(api_keys or [])          # `ApiKey`s carry their tenant's cache salt
        self.max_body = max_body
        self.max_concurrent = max_concurrent            # sequences (choices) in flight, all requests together
        self.max_seqs_per_request = max_seqs_per_request
        self.limits = limits or ServerLimits()
        self.sequences = 0                              # choices of the requests being served now
        self.drain = Drain()                            # SIGTERM: no new requests, those in flight finish
        self.prefetches = 0                             # context prefetches in flight (a drain waits for them)
        self.created = int(time.time())
        self.texts = TokenText(edge.tokenizer)

    # ---- app ----------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body, middlewares=[error_middleware(
            self.api_keys, self.max_body, lambda status: self.edge.count_error(str(status)), self.tenants)])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        if self.admin_key is not None:
            app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
            app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.router.add_post("/v1/contexts", self.prefetch)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/stats", self.stats)
        add_edge_routes(app, self.edge.tokenizer, self.edge.vocab_size, lambda: model_card(
            self.served_model, self.edge.max_model_len, self.created),   # /tokenize, /detokenize, /version, ...
            lambda: self.edge.adapters)
        return app

    def _capacity(self, parsed: ParsedRequest, request: web.Request) -> None:
        """400 for too many sequences, 429 for a tenant's limit, 503 for the node's capacity; then the tenant is
        charged (`GRANT`, finished in `_serve`)."""
        count = len(parsed.params)
        if count > self.max_seqs_per_request:
            prompts = count // parsed.n
            raise ApiError(400, f"This request asks for {prompts} prompt(s) × n={parsed.n} = {count} sequences; "
                                f"this server allows at most {self.max_seqs_per_request} per request",
                           "n" if parsed.n > 1 else "prompt", "too_many_sequences")
        self.drain.check()     # (a request that began before the drain and parsed during it)
        if not self.edge.ready:
            raise ApiError(503, "The engine is not running", None, "engine_unavailable",
                           headers={"x-should-retry": "false"})
        if self.sequences + count > self.max_concurrent:
            raise ApiError(503, f"The server is at capacity ({self.max_concurrent} sequences in flight); retry "
                                f"shortly", None, "server_overloaded", headers={"retry-after": "1"})
        state = request.get(TENANT)
        if state is None:
            return
        try:
            grant = state.admit(count, sum(map(len, parsed.prompts)), sum(p.max_tokens for p in parsed.params))
        except RateLimited as exc:
            self.tenant_metrics.rate_limited.labels(exc.tenant, exc.limit).inc()
            kind = "tokens" if exc.limit == "tokens_per_minute" else "requests"
            headers = {f"x-ratelimit-limit-{kind}": str(exc.value)}
            headers.update({"retry-after": str(max(1, math.ceil(exc.retry_after)))} if exc.retry_after is not None
                           else {"x-should-retry": "false"})
            raise ApiError(429, str(exc), None, "rate_limit_exceeded", kind, headers) from None
        request[GRANT] = grant
        self.tenant_metrics.requests.labels(state.name).inc()
        self.tenant_metrics.prompt_tokens.labels(state.name).inc(sum(map(len, parsed.prompts)))

    def _tenant_terms(self, request: web.Request, body: dict) -> None:
        """The key's tenant may use the model asked for (404 otherwise, as for a model that does not exist), and
        the request's engine terms: its tenant, weight and priority (the tenant's band, then vLLM's `priority`
        field, 0 to BAND_SPAN-1, lower first, ordering the request among its band's)."""
        priority = body.pop("priority", None)
        if priority is None:
            priority = 0
        if not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority < BAND_SPAN:
            raise ApiError(400, f"'priority' must be an integer from 0 (the default, most urgent) to {BAND_SPAN - 1}",
                           "priority", "invalid_value")
        state = request.get(TENANT)
        if state is None:
            if priority:
                request[ENGINE_TERMS] = {"priority": priority}
            return
        model = body.get("model") or self.served_model
        if not state.tenant.allows(model):
            raise ApiError(404, f"The model '{model}' does not exist or you do not have access to it.", "model",
                           "model_not_found")
        request[ENGINE_TERMS] = {"tenant": state.name, "weight": state.tenant.weight,
                                 "priority": state.tenant.engine_priority(priority)}

    def _model(self, request: web.Request, body: dict) -> None:
        """The base model, or a served LoRA adapter (its name joins the engine terms); 404 otherwise. After
        `_tenant_terms`, which sets the terms."""
        model = body.get("model")
        if isinstance(model, str) and model != self.served_model and model in self.edge.adapters:
            request[ENGINE_TERMS] = {**request.get(ENGINE_TERMS, {}), "adapter": model}
            return
        check_model(body, self.served_model)

    def _model_name(self, request: web.Request) -> str:
        """What a response says served it: the request's LoRA adapter (as vLLM), else the base model."""
        return request.get(ENGINE_TERMS, {}).get("adapter") or self.served_model

    # ---- endpoints ------------------------------------------------------------
    def start_drain(self) -> None:
        """Refuse new requests (503) and report not ready from now on; those being served go on, except those
        still waiting for their first output (edge/drain.py)."""
        self.drain.start()

    async def drained(self) -> None:
        """Returns once no request or context prefetch is being served (its last byte written, or its client
        gone)."""
        while self.sequences > 0 or self.prefetches > 0:
            await asyncio.sleep(0.05)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.drain.check()
        body = await json_body(request)
        self._tenant_terms(request, body)
        self._model(request, body)
        parsed = await off_loop(request, parse_completion, body, self.edge.tokenizer, self.edge.vocab_size,
                                self.edge.max_model_len)
        self._capacity(parsed, request)
        return await self._serve(request, parsed, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.drain.check()
        body = await json_body(request)
        self._tenant_terms(request, body)
        self._model(request, body)
        parsed = await off_loop(request, parse_chat, body, self.edge.tokenizer, self.edge.vocab_size,
                                self.edge.max_model_len)
        self._capacity(parsed, request)
        return await self._serve(request, parsed, chat=True)

    async def prefetch(self, request: web.Request) -> web.Response:
        """Context prefetch: a core (or an operator) pushes a shared prefix here ahead of requests."""
        self.drain.check()
        body = await json_body(request)
        tok = self.edge.tokenizer
        ids = body.get("token_ids")
        if ids is None and isinstance(body.get("text"), str) and body["text"]:
            try:
                ids = await off_loop(request, tok.encode, body["text"], True, self.edge.max_model_len)
            except TextTooLong:
                raise ApiError(400, "the context is longer than the model's context", "text",
                               "context_length_exceeded") from None
        vocab = self.edge.vocab_size
        if not isinstance(ids, list) or not ids or any(
                not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise ApiError(400, "give 'token_ids' (a non-empty list of token ids) or 'text'", "token_ids",
                           "invalid_value")
        if len(ids) >= self.edge.max_model_len:
            raise ApiError(400, "the context is longer than the model's context", "token_ids",
                           "context_length_exceeded")
        self.prefetches += 1
        try:
            result = await self.edge.prefetch(ids)
        finally:
            self.prefetches -= 1
        return web.json_response({"object": "context", **result})

    async def models(self, request: web.Request) -> web.Response:
        """The base model and each LoRA adapter (`parent`: the base), those the key's tenant may use."""
        state = request.get(TENANT)
        base = model_card(self.served_model, self.edge.max_model_len, self.created)
        cards = [base, *adapter_cards(base, self.edge.adapters)]
        if state is not None:
            cards = [c for c in cards if state.tenant.allows(str(c["id"]))]
        return web.json_response({"object": "list", "data": cards})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's runtime adapter loading: {"lora_name", "lora_path"} (a directory on this node); admin key only."""
        assert self.admin_key is not None           # the route exists only with one
        self.admin_key.check(request)
        body = await json_body(request)
        name, path = _text_field(body, "lora_name"), _text_field(body, "lora_path")
        if name == self.served_model:
            raise ApiError(400, f"'{name}' is the base model's name", "lora_name", "invalid_value")
        try:
            await self.edge.load_adapter(name, path)
        except AdapterError as exc:
            raise ApiError(400, str(exc), exc.param, exc.code) from None
        log.info("LoRA adapter '%s' loaded from %s", name, path)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's runtime adapter unloading: {"lora_name"}; requests running on it finish with it."""
        assert self.admin_key is not None
        self.admin_key.check(request)
        name = _text_field(await json_body(request), "lora_name")
        if name not in self.edge.adapters:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "model_not_found")
        try:
            await self.edge.unload_adapter(name)
        except AdapterError as exc:
            raise ApiError(404, str(exc), exc.param, "model_not_found") from None
        log.info("LoRA adapter '%s' unloaded", name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def health(self, _: web.Request) -> web.Response:
        """Liveness: 503 from the moment the engine (its thread, or the engine process) is known dead, before the
        frontend's own shutdown finishes, so a probe never reads a dead edge as alive."""
        if not self.edge.ready:
            return web.json_response({"status": "engine_dead"}, status=503)
        return web.json_response({"status": "ok"})

    async def ready(self, _: web.Request) -> web.Response:
        if self.drain.draining:
            return web.json_response({"ready": False, "draining": True}, status=503)
        try:
            readiness = await self.edge.get_readiness()
        except EngineDead:
            readiness = {"ready": False, "cores_healthy": 0}
        return web.json_response(readiness, status=200 if readiness["ready"] else 503)

    async def metrics(self, _: web.Request) -> web.Response:
        try:
            engine = await self.edge.get_metrics()
        except EngineDead as exc:       # stopping (after a drain), or the engine process failed
            raise ApiError(503, f"metrics unavailable: {exc}", None, "engine_unavailable") from None
        return web.Response(body=(engine + self.tenant_metrics.text()).encode(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stats(self, _: web.Request) -> web.Response:
        return web.json_response(await self.edge.get_stats())

    # ---- generation -------------------------------------------------------------
    async def _serve(self, request: web.Request, parsed: ParsedRequest, chat: bool) -> web.StreamResponse:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        count = len(parsed.params)
        salt = effective_cache_salt(request, parsed.cache_salt)
        grant = request.get(GRANT)       # the tenant's charge, taken in _capacity
        terms = request.get(ENGINE_TERMS)
        tr, span = tracer(), None
        if tr is not None:     # the request's span (under an inbound traceparent): the engine's spans go under it
            span = tr.start(f"POST {request.path}", parse_traceparent(request.headers.get("traceparent")),
                            kind="server", request_id=rid, choices=count, stream=parsed.stream)
            span.set(**{"http.request.method": "POST", "url.path": request.path,
                        "gen_ai.request.model": self._model_name(request)})
            terms = {**(terms or {}), "traceparent": span.traceparent}
        self.sequences += count          # checked in _capacity with no await since: no other request raced in
        try:
            choices = self._choices(parsed, rid, salt, terms)
            async with contextlib.aclosing(choices if grant is None else self._metered(choices, grant)) as outputs:
                # the first output before the 200: an engine's refusal is still a 4xx, a drain still a 503
                first = await self.drain.first_output(outputs)
                if parsed.stream:
                    return await self._stream(request, parsed, chat, rid, created, _prepend(first, outputs))
                return await self._collect(parsed, chat, rid, created, _prepend(first, outputs),
                                           self._model_name(request))
        except ApiError as exc:
            if span is not None:
                span.fail(f"{exc.status} {exc}")
            raise
        finally:
            if span is not None:
                span.end()
            self.sequences -= count
            if grant is not None:
                grant.finish()
                self.tenant_metrics.in_flight.labels(grant.state.name).set(grant.state.in_flight)

    async def _metered(self, outputs: AsyncGenerator[tuple[int, RequestOutput], None], grant: Grant
                       ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """`outputs`, the tokens generated counted for the tenant (metrics; `grant` returns what was unused)."""
        counter = self.tenant_metrics.generation_tokens.labels(grant.state.name)
        self.tenant_metrics.in_flight.labels(grant.state.name).set(grant.state.in_flight)
        async with contextlib.aclosing(outputs):
            async for i, out in outputs:
                if out.new_token_ids:
                    grant.generated += len(out.new_token_ids)
                    counter.inc(len(out.new_token_ids))
                yield i, out

    async def _choices(self, parsed: ParsedRequest, rid: str, salt: str | None, terms: dict[str, Any] | None = None
                       ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(choice index, RequestOutput) as they come, every choice under the request's cache `salt` (and its
        tenant's engine `terms`, `_tenant_terms`). One choice streams straight from the engine; several are
        merged through a queue. An engine failure becomes an ApiError."""
        count = len(parsed.params)
        terms = terms or {}
        if count == 1:
            try:
                async for out in self.edge.generate(f"{rid}-0", parsed.prompts[0], parsed.params[0], rid, salt,
                                                    **terms):
                    yield 0, out
            except RequestError as exc:    # what only the engine can check (a grammar's language, ...)
                raise ApiError(_status(exc), str(exc), exc.param, exc.code) from None
            except EngineDead as exc:
                raise ApiError(500, f"generation failed: {exc}", None, "internal_error") from None
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for out in self.edge.generate(f"{rid}-{i}", parsed.prompts[i // parsed.n], parsed.params[i],
                                                    rid, salt, **terms):
                    queue.put_nowait((i, out))
                queue.put_nowait((i, None))
            except RequestError as exc:
                queue.put_nowait((i, exc))
            except Exception as exc:   # engine failure: reported to the client, never a hang
                log.exception("choice %d of %s failed", i, rid)
                queue.put_nowait((i, exc))

        tasks = [asyncio.create_task(pump(i)) for i in range(count)]
        try:
            remaining = count
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, RequestError):
                    raise ApiError(_status(item), str(item), item.param, item.code)
                elif isinstance(item, Exception):
                    raise ApiError(500, f"generation failed: {item}", None, "internal_error")
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()

    async def _collect(self, parsed: ParsedRequest, chat: bool, rid: str, created: int,
                       outputs: AsyncIterator[tuple[int, RequestOutput]], model: str) -> web.Response:
        results = [ChoiceResult() for _ in parsed.params]
        async for i, out in outputs:
            results[i].add(out)
        body = response_body(parsed, results, chat, rid, created, model, self.texts,
                             self.edge.fingerprint[:16] or None)
        return web.Response(body=json_encode(body), content_type="application/json")

    async def _stream(self, request: web.Request, parsed: ParsedRequest, chat: bool, rid: str, created: int,
                      outputs: AsyncIterator[tuple[int, RequestOutput]]) -> web.StreamResponse:
        count = len(parsed.params)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": rid, "object": obj, "created": created, "model": self._model_name(request)}

        async def send(payload: dict[str, Any]) -> None:
            await resp.write(b"data: " + json_encode(payload) + b"\n\n")

        # Token chunks differ only in their choice: the rest of the event is encoded once.
        head = b"data: " + json_encode({**base, "choices": []})[:-2]      # ends with "choices":[
        toks = [0] * count          # tokens generated so far, per choice

        def tail(i: int) -> bytes:  # a chunk's end: with vLLM's continuous usage, its choice's usage so far
            return b'],"usage":' + json_encode(usage_so_far(parsed, i, toks[i])) + b"}\n\n" \
                if parsed.continuous_usage else b"]}\n\n"

        for i in range(count) if chat or parsed.echo else ():     # chat: the role; completions: the echo
            opening = {"delta": {"role": "assistant", "content": ""}} if chat \
                else {"text": parsed.prompt_texts[i // parsed.n]}
            await resp.write(head + json_encode({"index": i, **opening, "logprobs": None, "finish_reason": None})
                             + tail(i))
        cached: dict[int, int] = {}
        offsets = [0] * count
        tool_streams = [parsed.tools.stream() for _ in range(count)] if parsed.tools is not None else []
        try:
            async for i, out in outputs:
                cached.setdefault(i // parsed.n, out.num_cached_tokens)
                toks[i] += len(out.new_token_ids)
                if not out.new_text and not out.finished and not out.logprobs:
                    continue
                reason = out.finish_reason if out.finished else None
                if chat:
                    lp = self.texts.chat_logprobs(out.logprobs or []) if parsed.logprobs is not None else None
                if chat and tool_streams:
                    for choice in tool_streams[i].chunks(i, out.new_text, out.finished, out.finish_reason, lp):
                        await resp.write(head + json_encode(choice) + tail(i))
                    continue
                if chat:
                    delta = {"content": out.new_text} if out.new_text or not out.finished else {}
                    choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
                else:
                    lp = self.texts.completion_logprobs(out.logprobs or [], offsets[i]) \
                        if parsed.logprobs is not None else None
                    choice = {"index": i, "text": out.new_text, "logprobs": lp, "finish_reason": reason}
                offsets[i] += len(out.new_text)
                await resp.write(head + json_encode(choice) + tail(i))
            if parsed.include_usage:
                await send({**base, "choices": [], "usage": usage(parsed, sum(toks), sum(cached.values()))})
        except ApiError as exc:       # the 200 is sent: the error goes in the stream, and is counted
            self.edge.count_error(str(exc.status))
            await send(exc.body())
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def start_http(http: EdgeHTTP, host: str, port: int, tls: ServerTLS | None = None
                     ) -> tuple[web.AppRunner, int]:
    """Serve the API on host:port under `http.limits` (HTTPS with `tls`). Returns (runner, bound port)."""
    return await start_site(http.build_app(), host, port, http.limits, handler_cancellation=True, tls=tls)


def _status(exc: RequestError) -> int:
    """An engine's refusal: 404 for a model (adapter) it does not serve (unloaded meanwhile), else 400."""
    return 404 if exc.code == "model_not_found" else 400


def _text_field(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"'{name}' must be a non-empty string", name, "invalid_value")
    return value


async def _prepend(first: T | None, rest: AsyncIterator[T]) -> AsyncGenerator[T, None]:
    """`first` (unless None), then what `rest` yields."""
    if first is not None:
        yield first
    async for item in rest:
        yield item
