"""vLLM's extra routes and the model card, for the edge's API and the core's control port.

Life cycle: a node's app builder calls `add_edge_routes(app, ...)` (edge:
/tokenize, /detokenize, /version, /v1/models/{id}) or `add_model_routes(app,
card)` (core: /v1/models, /v1/models/{id}); each handler validates its body
with the same schema machinery as the completions endpoints (`schemas.py`),
so a bad body is a 400 naming the field. `card()` is read per request: the
model is known only once the node has loaded it.
"""

from __future__ import annotations

from typing import Annotated
from collections.abc import Callable, Iterable

from aiohttp import web
from msgspec import Meta, Struct

from edgecore.shared.errors import RequestError
from edgecore.shared.openai.errors import ApiError
from edgecore.shared.openai.http import TENANT, json_body, off_loop
from edgecore.shared.openai.schemas import ChatMessage, TokenId, decode_body
from edgecore.shared.openai.request import check_model, render_message
from edgecore.shared.text.tokenizer import Tokenizer

Card = Callable[[], dict]


def model_card(name: str, max_model_len: int, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "edgecore", "root": name,
            "parent": None, "max_model_len": max_model_len}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version
    try:
        return dist_version("edgecore")
    except PackageNotFoundError:
        return "unknown"


class TokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    tokens: Annotated[list[TokenId], Meta(max_length=1 << 20)]


def adapter_cards(card: dict, adapters: Iterable[str]) -> list[dict]:
    """The model cards of LoRA adapters (shared/models/lora.py): vLLM's, with the base model as `parent`."""
    return [{**card, "id": name, "root": name, "parent": card["id"]} for name in sorted(adapters)]


def add_model_routes(app: web.Application, card: Card, list_route: bool = True,
                     adapters: Callable[[], Iterable[str]] | None = None) -> None:
    """/v1/models/{id} (and /v1/models with `list_route`): the base model's card and its LoRA adapters', those
    the key's tenant may use (a model it may not use is a 404, as one that does not exist)."""
    def cards(request: web.Request) -> list[dict]:
        c = card()
        every = [c, *adapter_cards(c, adapters())] if adapters is not None else [c]
        state = request.get(TENANT)
        return every if state is None else [c for c in every if state.tenant.allows(str(c["id"]))]

    async def one(request: web.Request) -> web.Response:
        for c in cards(request):
            if request.match_info["model_id"] == c["id"]:
                return web.json_response(c)
        raise ApiError(404, f"The model '{request.match_info['model_id']}' does not exist (this server serves "
                       f"'{card()['id']}')", "model", "model_not_found")

    async def listing(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": cards(request)})

    app.router.add_get("/v1/models/{model_id:.+}", one)
    if list_route:
        app.router.add_get("/v1/models", listing)


def _tokenize(req: TokenizeRequest, tokenizer: Tokenizer) -> list[int]:
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of 'prompt' or 'messages'", "prompt", "invalid_value")
    if req.prompt is not None:
        return tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    assert req.messages is not None     # exactly one of the two is given (checked above)
    rendered = [render_message(msg, i) for i, msg in enumerate(req.messages)]
    try:
        return tokenizer.encode_chat(rendered, add_generation_prompt=req.add_generation_prompt)
    except RequestError as exc:
        raise ApiError(400, str(exc), "messages", "invalid_value") from None


def add_edge_routes(app: web.Application, tokenizer: Tokenizer, vocab: int, card: Card,
                    adapters: Callable[[], Iterable[str]] | None = None) -> None:
    """/tokenize, /detokenize and /version as vLLM serves them, and /v1/models/{id}."""
    async def tokenize(request: web.Request) -> web.Response:
        body = await json_body(request)
        check_model(body, card()["id"])
        req = decode_body(body, TokenizeRequest)
        ids = await off_loop(request, _tokenize, req, tokenizer)
        out = {"count": len(ids), "max_model_len": card()["max_model_len"], "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        return web.json_response(out)

    async def detokenize(request: web.Request) -> web.Response:
        body = await json_body(request)
        check_model(body, card()["id"])
        req = decode_body(body, DetokenizeRequest)
        if any(t >= vocab for t in req.tokens):
            raise ApiError(400, f"token ids must be in [0, {vocab})", "tokens", "invalid_value")
        return web.json_response({"prompt": tokenizer.decode(req.tokens)})

    async def version_route(_: web.Request) -> web.Response:
        return web.json_response({"version": version()})

    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version_route)
    add_model_routes(app, card, list_route=False, adapters=adapters)
