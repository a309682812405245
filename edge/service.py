"""What the edge's HTTP frontend asks of the edge: the `EdgeService` protocol.

Life cycle of the seam: `EdgeHTTP` (edge/http.py) is built on an `EdgeService`
and uses nothing else of it. Two classes implement it: `EdgeNode`
(edge/node.py: placement, remote prefill, decode, in this process) and
`NodeProcessClient` (edge/node_client.py: the same calls as typed messages to the
edge's engine process, edge/ipc.py). The service is ready once its engine
runs; `generate` streams one request's outputs (a consumer that leaves aborts
the request; `cache_salt` scopes its prefix cache, `tenant`, `weight` and
`priority` place it among the tenants, `adapter` names its LoRA adapter, `traceparent` the span it runs under:
shared/engine/handle.py `EngineRequest`);
`adapters` are the LoRA adapters served (name → fingerprint), changed by `load_adapter` / `unload_adapter`
(shared/models/lora.py `AdapterError`: nothing changed); the rest are reads of published state and small commands.
"""

from __future__ import annotations

from typing import Protocol
from collections.abc import AsyncIterator

from edgecore.shared.engine.output import RequestOutput
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.text.tokenizer import Tokenizer


class EdgeService(Protocol):
    tokenizer: Tokenizer
    active: int                         # requests in flight through this service

    @property
    def ready(self) -> bool: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def fingerprint(self) -> str: ...

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, group: str | None = None,
                 cache_salt: str | None = None, *, tenant: str | None = None, weight: float = 1.0,
                 priority: int = 0, adapter: str | None = None, traceparent: str | None = None
                 ) -> AsyncIterator[RequestOutput]: ...

    @property
    def adapters(self) -> dict[str, str]: ...

    async def load_adapter(self, name: str, path: str) -> str: ...

    async def unload_adapter(self, name: str) -> None: ...

    async def prefetch(self, prompt_ids: list[int]) -> dict: ...

    async def get_stats(self) -> dict: ...

    async def get_metrics(self) -> str: ...

    async def get_readiness(self) -> dict: ...

    def count_error(self, status: str) -> None: ...
