"""What the edge asks a core for one remote prefill: a frozen value, built before anything is sent.

Life cycle: the edge's settings (`RemotePrefillSettings`, the same for every request) are fixed when the edge
starts. For one request, after the edge has reserved blocks (its cached prefix, `skip_tokens`) and chosen the
codec, `PrefillPlan.build` decides, as a pure function of those inputs, what the core is asked: the prompt,
the codec, the prefix the edge already holds, how many tokens after the first the core may decode for it
(`core_decode`; 0 unless the request decodes here and the core speaks decode handover), how many leading
layers the edge computes itself (`edge_layers`: layer 0 of a lossy transfer within the edge's budget,
shared/kv/transfer.py), and the fairness group. The plan never changes afterwards; from it come the
`PrefillRequest` sent to the core (`request()`), the sans-IO `KVReceiver` that checks what arrives
(`receiver()`), and what the edge keeps of each token the core sampled (`token()`). It has no states.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgecore.protocol.kv_receiver import KVReceiver
from edgecore.protocol import messages as m
from edgecore.protocol.codecs import get_codec
from edgecore.shared.models.config import ModelConfig
from edgecore.shared.engine.handle import EngineRequest, FirstToken
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.kv.transfer import layers_at_edge, needed_from


@dataclass(frozen=True, slots=True)
class RemotePrefillSettings:
    """The edge's rules for every remote prefill: `timeout`, seconds for the whole transfer (also each wait for
    the core's next event, and the core's deadline); `core_decode`, tokens after the first a core may decode
    before the edge takes over (0: never); `rope`, the model's RoPE for the codecs, what the core's encoder took
    (`codec_rope`); `layer0_budget_macs`, the most multiply-adds this edge spends computing layer 0's KV of a
    lossy transfer itself (`edge_layers`)."""
    timeout: float
    core_decode: int = 0
    rope: tuple[float, ...] | None = None
    layer0_budget_macs: float = 0.0


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    codec: str
    skip_tokens: int               # the prefix cached at the edge: the core sends none of its KV
    core_decode: int               # tokens after the first the core may decode (0: no decode handover)
    edge_layers: int               # leading layers whose KV the edge computes (0 or 1)
    direct: bool                   # the client holds a stream connection to each of the core's ranks
    deadline_ms: int
    group: str | None = None       # the request's fairness group, here and at the core
    cache_salt: str | None = None  # the request's prefix-cache scope, here and at the core
    tenant: str | None = None      # the request's tenant: its fair share here and at the core
    adapter: str | None = None     # the request's LoRA adapter (shared/models/lora.py) and its content fingerprint:
    adapter_fingerprint: str = ""  # the core prefills with its own copy, which must be the same
    traceparent: str | None = None  # the edge's span of this prefill: the core's spans go under it

    @classmethod
    def build(cls, request: EngineRequest, skip_tokens: int, codec: str, settings: RemotePrefillSettings, *,
              layer0_macs_per_token: int, core_decodes: bool, direct: bool, adapter_fingerprint: str = "") -> PrefillPlan:
        """`core_decodes`: the request decodes here (it has a sink) and the core speaks decode handover;
        `layer0_macs_per_token`: the engine's multiply-adds per token of layer 0's KV (0: it cannot compute it)."""
        assert isinstance(request.prompt, list), "a remote prefill's prompt is token ids"
        prompt, params = request.prompt, request.params
        limit = min(settings.core_decode, params.max_tokens - 1) if core_decodes else 0
        edge_layers = layers_at_edge(layer0_macs_per_token, len(prompt) - skip_tokens, settings.layer0_budget_macs,
                                     get_codec(codec).lossless)
        return cls(request.request_id, prompt, params, codec, skip_tokens, limit, edge_layers, direct,
                   int(settings.timeout * 1000), request.group, request.cache_salt, request.tenant, request.adapter,
                   adapter_fingerprint, request.traceparent)

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids)

    def request(self) -> m.PrefillRequest:
        """The message that starts the prefill at the core."""
        return m.PrefillRequest(self.request_id, self.prompt_ids, m.SamplingSpec(**self.params.spec_fields()),
                                [self.codec], self.deadline_ms, self.skip_tokens, direct=self.direct,
                                core_decode=self.core_decode, edge_layers=self.edge_layers, group=self.group or "",
                                cache_salt=self.cache_salt or "", tenant=self.tenant or "",
                                adapter=self.adapter or "", adapter_fingerprint=self.adapter_fingerprint,
                                traceparent=self.traceparent or "")

    def receiver(self, cfg: ModelConfig) -> KVReceiver:
        """The sans-IO check of the KV this plan asks for (a decoding core streams as the ranks of a parallel
        core do: chunks may follow PrefillDone)."""
        return KVReceiver(self.request_id, cfg.num_hidden_layers, cfg.num_key_value_heads, self.total_tokens,
                          self.skip_tokens, direct=self.direct or self.core_decode > 0,
                          needed_from=needed_from(cfg, self.total_tokens, self.edge_layers),
                          values_per_head=cfg.kv_bytes_per_token(1) // (
                              cfg.num_hidden_layers * cfg.num_key_value_heads))

    def token(self, token: int, logprob: float, top: list[tuple[int, float]],
              cached_tokens: int | None = None) -> FirstToken:
        """What the edge keeps of a token the core sampled: its logprobs only when the request asked for them;
        with the first, the prompt tokens the core did not compute (PrefillDone's `cached_tokens`: it computes
        the prompt from its own cached prefix on, whatever the edge holds), which the usage reports."""
        return FirstToken(token, logprob if self.params.logprobs is not None else None,
                          [(int(t), float(p)) for t, p in top], cached_tokens)
