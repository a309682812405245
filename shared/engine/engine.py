"""The generation engine: requests in, token/text deltas out, one step at a time.

Life cycle of an ordinary request: `add_request` validates and queues it; each `step()` schedules a
batch (continuous batching, chunked prefill, preemption), runs the model, samples, and returns one
`RequestOutput` per request that produced a token; a finished request's blocks are freed at once
(`abort` does the same for a live request).

Two entry points serve disaggregated serving:
(a) prefill only — `add_request(..., prefill_only=True)`: after its first token the request is
    PREFILLED with its KV kept; `read_kv` / `read_kv_slices` hand out K/V (the `on_layer` hook
    of `step` signals each layer as it is computed) and `release` frees it.
(b) KV from outside — `reserve` allocates blocks for a prompt (reusing the local prefix
    cache; the request is AWAITING_KV), `write_kv` fills slices as they arrive, and
    `activate(first_token)` joins the request to the decode batch. With decode handover the
    tokens a core decoded meanwhile come first: `push_token` runs each through the request's
    output rules (emitted with the next step's outputs unless the caller takes them,
    `take_pending`; a request they finish never decodes here), and `take_over(kv_until)` joins
    the batch with KV valid for [0, kv_until): the tokens after it (those decoded elsewhere, or
    all but the cached prefix after a failed transfer) are computed here as one prefill chunk.
LoRA adapters (shared/models/lora.py): the engine's `LoraRegistry` (`lora`) loads and unloads them; a request names
its adapter (`adapter=`), which scopes its prefix cache (`adapter_salt`) and gives its rows the adapter's slot.
Disk KV tier (`CacheConfig.tier_dir`; shared/engine/tier_loads.py): a request whose prefix blocks after the
pool's are on disk waits outside the scheduler while they are read back, then is queued with them cached;
evicted cached blocks spill there; `close()` writes the blocks still cached and stops the tier.
Only the engine thread calls these (through `EngineThread`, the in-thread `EngineHandle`, which
first has `compile_decode` run there); `stats()` builds the snapshot that thread publishes.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from collections.abc import Callable

import torch

from edgecore.shared.models.config import CacheConfig, EngineConfig, ModelConfig
from edgecore.shared.engine.grammar import Grammars
from edgecore.shared.engine.handle import EngineStats
from edgecore.shared.engine.kv_handout import KVHandout
from edgecore.shared.engine.model_runner import ModelRunner
from edgecore.shared.engine.output import OutputState, RequestOutput
from edgecore.shared.engine.request_checks import check_request
from edgecore.shared.engine.sampler import SampleResult
from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.engine.scheduler import Scheduler
from edgecore.shared.engine.tier_loads import open_tier
from edgecore.shared.engine.sequence import Sequence, Status
from edgecore.shared.engine.speculative import Speculator
from edgecore.shared.engine.draft_model import DraftModel
from edgecore.shared.errors import ConfigError, RequestError
from edgecore.shared.models.fingerprint import model_fingerprint, with_quantize
from edgecore.shared.text.gguf_tokenizer import gguf_has_tokenizer
from edgecore.shared.kv.block_manager import BlockManager, NoFreeBlocks
from edgecore.shared.kv.pool import KVPool
from edgecore.shared.kv.transfer import KVSlice, DirectRoute, needed_from
from edgecore.shared.models.lora import LoraRegistry, adapter_salt
from edgecore.shared.node.metrics import Buckets
from edgecore.shared.models.layers import weight_bytes
from edgecore.shared.models.loader import load_model, resolve_dtype
from edgecore.shared.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from edgecore.shared.models.llama import Attention, LlamaForCausalLM
    from edgecore.shared.models.mla import MLAttention

TIER_WAIT_S = 0.005       # an idle step waits this long at most for a disk tier read

LayerHook = Callable[[int, list[tuple[Sequence, int]]], None]


class LLMEngine(KVHandout):
    def __init__(self, model: LlamaForCausalLM, config: ModelConfig, tokenizer: Tokenizer | None = None,
                 cache_config: CacheConfig | None = None, engine_config: EngineConfig | None = None,
                 fingerprint: str | None = None):
        """`fingerprint`: the model's (shared/models/fingerprint.py), which keys the disk KV tier (`from_dir` gives it)."""
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.cache_config = cache_config or CacheConfig()
        self.engine_config = engine_config or EngineConfig()
        self.max_model_len = self.engine_config.max_model_len or config.max_position_embeddings
        if config.rope_scaling.rope_type == "dynamic" and self.max_model_len > config.max_position_embeddings:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds max_position_embeddings "
                              f"{config.max_position_embeddings}: dynamic NTK RoPE is served up to that length only")
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, str(param.device)
        kv_heads = cast("Attention | MLAttention", model.model.layers[0].self_attn).num_kv_heads
        self.pool = KVPool(config, self.cache_config, self.dtype, self.device, num_kv_heads=kv_heads,
                           num_layers=len(model.model.layers))
        self.block_manager = BlockManager(self.cache_config.num_blocks, self.cache_config.block_size,
                                          self.cache_config.enable_prefix_caching,
                                          resident_blocks=self.cache_config.resident_blocks)
        self.scheduler = Scheduler(self.block_manager, self.engine_config)
        # The disk KV tier (tier_loads.py): cached blocks spill there, prefixes load back; keyed by --quantize too.
        self.tier = open_tier(self.cache_config, config, self.pool, self.block_manager,
                              None if fingerprint is None else with_quantize(fingerprint, self.engine_config.quantize,
                                                                             self.cache_config.kv_dtype))
        self.runner = ModelRunner(model, self.pool, config.sliding_window, self.engine_config.compile_decode)
        spec = self.engine_config.speculative     # drafts verified per step (speculative.py)
        drafter = None if spec is None or spec.method != "draft_model" or spec.model is None else \
            DraftModel(spec.model, config, self.cache_config, self.dtype, self.device)
        self.speculator = None if spec is None else Speculator(spec, self.block_manager, self.max_model_len, drafter,
                                                               self.engine_config.max_num_batched_tokens)
        self.releases_kv = config.releases_kv      # (blocks released in `step`)
        self.requests: dict[str, OutputState] = {}
        self.eos_ids = config.eos_token_ids or ((tokenizer.eos_token_id,) if tokenizer and
                                                 tokenizer.eos_token_id is not None else ())
        self._pending: list[RequestOutput] = []
        self.grammars: Grammars | None = None     # built on the first request with a grammar
        self.iteration_tokens = Buckets()          # tokens computed per step (a metric)
        self.kv_bytes_per_token = self.pool.bytes // max(1, self.pool.num_slots)
        self.weights_bytes = weight_bytes(model)
        # LoRA adapters (`lora.load`, `lora.unload`): the slots of live requests' adapters stay until they finish
        self.lora = self.runner.lora = LoraRegistry(model, lambda: {s.seq.lora_slot for s in self.requests.values()},
                                                    lambda: type(self.runner) is ModelRunner)

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: str | torch.dtype | None = "auto", device: str = "cpu",
                 cache_config: CacheConfig | None = None, engine_config: EngineConfig | None = None) -> LLMEngine:
        config = ModelConfig.from_dir(model_dir)
        # A checkpoint without tokenizer files still serves token-id prompts.
        tokenizer = Tokenizer.from_dir(model_dir) if (Path(model_dir) / "tokenizer.json").is_file() or \
            gguf_has_tokenizer(model_dir) else None          # a GGUF file: its own or the one beside it
        model = load_model(model_dir, resolve_dtype(dtype, device), device, config=config,
                           quantize=engine_config.quantize if engine_config else None)
        fingerprint = model_fingerprint(model_dir, config) if cache_config and cache_config.tier_dir else None
        return cls(model, config, tokenizer, cache_config, engine_config, fingerprint)

    # ---- requests -------------------------------------------------------
    def _new_sequence(self, request_id: str, prompt: str | list[int], params: SamplingParams, prefill_only: bool,
                      priority: int = 0, group: str | None = None, cache_salt: str | None = None,
                      tenant: str | None = None, weight: float = 1.0, adapter: str | None = None) -> Sequence:
        if request_id in self.requests:
            raise RequestError(f"request id '{request_id}' is already in use", param="request_id")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer; pass token ids", param="prompt")
            prompt = self.tokenizer.encode(prompt)
        ids = list(prompt)
        check_request(ids, params, prefill_only, self.config.vocab_size, self.max_model_len,
                      self.cache_config.num_blocks * self.cache_config.block_size)
        lora = self.lora.resolve(adapter)
        seq = Sequence(request_id, ids, params, prefill_only, priority, group, adapter_salt(cache_salt, lora), tenant,
                       weight)
        if lora is not None:
            seq.adapter, seq.lora_slot = lora.name, lora.slot
        if params.guided is not None:
            seq.grammar = self._grammars().matcher(params.guided)
        self.requests[request_id] = OutputState(seq, self.tokenizer, self.eos_ids, self.max_model_len)
        return seq

    def _grammars(self) -> Grammars:
        if self.grammars is None:
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer, so it cannot follow a grammar", param="guided")
            self.grammars = Grammars(self.tokenizer.backend.to_str(), self.config.vocab_size, tuple(self.eos_ids))
        return self.grammars

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    prefill_only: bool = False, priority: int = 0, group: str | None = None,
                    cache_salt: str | None = None, tenant: str | None = None, weight: float = 1.0,
                    adapter: str | None = None) -> Sequence:
        """Queue a request (`adapter`: a loaded LoRA adapter's name, None the base model); `group`: its fairness group (the scheduler shares each step between groups), by
        default the request alone; `cache_salt`: its prefix cache's scope (blocks are reused only between
        requests with the same salt; None: unsalted); `tenant` and `weight`: its tenant and the tenant's share
        of the engine (the scheduler shares each step between tenants by weight, then between their groups)."""
        seq = self._new_sequence(request_id, prompt, params or SamplingParams(), prefill_only, priority, group,
                                 cache_salt, tenant, weight, adapter)
        if self.tier is None or seq.params.prompt_logprobs is not None or not self.tier.begin(seq):
            self.scheduler.add(seq)         # (else queued once its prefix is read back from the disk tier)
        return seq

    def abort(self, request_id: str) -> bool:
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        seq = state.seq
        if self.tier is not None and self.tier.forget(request_id):     # still reading its prefix: in no queue
            seq.status = Status.FINISHED
        elif seq.status in (Status.PREFILLED, Status.AWAITING_KV):
            self.block_manager.free_table(seq.table)
            seq.status = Status.FINISHED
        elif seq.status is not Status.FINISHED:
            self.scheduler.finish(seq, "abort")
        self.lora.collect_pending()         # an unloaded adapter's slot, once its last request is gone
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending) or bool(self.tier is not None and self.tier.loading)

    def get(self, request_id: str) -> Sequence | None:
        state = self.requests.get(request_id)
        return state.seq if state else None

    def cached_prefix(self, prompt_ids: list[int], cache_salt: str | None = None, adapter: str | None = None) -> int:
        """How many leading tokens of the prompt the prefix cache holds under `cache_salt` (whole blocks), for
        requests of `adapter` (an unknown one: none)."""
        lora = self.lora.get(adapter) if adapter is not None else None
        if adapter is not None and lora is None:
            return 0
        salt = adapter_salt(cache_salt, lora)
        if self.tier is not None:       # the pool's prefix and the disk tier's blocks after it
            return self.tier.cached_tokens(prompt_ids, salt)
        return len(self.block_manager.match_prefix(prompt_ids, salt)) * self.block_manager.block_size

    # ---- stepping -------------------------------------------------------
    def _settle_tier(self) -> None:
        """Prefixes read back from the disk tier are now cached in the pool: queue the requests that waited."""
        if self.tier is not None:
            for seq in self.tier.settle():
                self.scheduler.add(seq)

    def prefetch_prefix(self, request_id: str, prompt: str | list[int], cache_salt: str | None = None,
                        adapter: str | None = None) -> Future[Any] | None:
        """Before `reserve`: start reading the prompt's blocks after the pool's prefix from the disk tier; the
        future to await off the engine thread (None: nothing to read). The blocks stay pinned for the
        reservation of `request_id`, which takes them as cached."""
        lora = self.lora.get(adapter) if self.lora is not None and adapter is not None else None
        if self.tier is None or not isinstance(prompt, list) or (adapter is not None and lora is None):
            return None
        return self.tier.prefetch(request_id, prompt, adapter_salt(cache_salt, lora))

    def compile_decode(self) -> None:
        """If `EngineConfig.compile_decode`: compile the decode step now, for this thread (else step 1 does)."""
        self.runner.compile_decode()

    def step(self, on_layer: LayerHook | None = None) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        self.lora.collect_pending()         # requests finished by activate / push_token since the last step
        self._settle_tier()
        spec = self.speculator        # (with drafts: speculative.py)
        start = time.perf_counter()     # (a step's cost, drafting included, judges whether drafts pay)
        batch = self.scheduler.schedule() if spec is None else spec.schedule(self.scheduler)
        if self.tier is not None:
            self.tier.release_admitted()
            if not batch and not outputs:           # nothing to run but disk reads: wait briefly for one
                self.tier.wait(TIER_WAIT_S)
        if not batch:
            return outputs
        samplers, result = self.runner.run(batch, on_layer)
        self.iteration_tokens.observe(sum(n for _, n in batch.items))
        if spec is not None:
            spec.observe(batch.items, time.perf_counter() - start)
            spec.settle(batch.items)
        self.scheduler.complete(batch)
        for seq, _ in batch.items if self.releases_kv else ():    # KV no layer attends to any more
            if not seq.prefill_only and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self.block_manager.release_before(seq.table, self.config.first_needed_position(seq.num_computed_tokens))
        if result is None:              # nothing sampled this step (prefill chunks only)
            return outputs
        for i, seq in enumerate(samplers):
            self._emit(seq, result, i, outputs)
        self.lora.collect_pending()         # an unloaded adapter's slot, once its last request finished
        return outputs

    def _emit(self, seq: Sequence, result: SampleResult, i: int, outputs: list[RequestOutput]) -> None:
        """Push sampler `i`'s token (a drafted sequence's accepted drafts, then one) through its output rules."""
        state = self.requests[seq.request_id]
        lp = result.logprobs[i] if result.logprobs is not None and seq.params.logprobs is not None else None
        top = result.top[i] if result.top is not None else None
        tokens = result.drafted.get(i) or [result.token_ids[i]]
        pushed: list[RequestOutput] = []
        for token in tokens:
            out = state.push(token, lp, top)
            if seq.prefill_only:   # stop rules apply where decoding happens, not here
                out.finished, out.finish_reason = True, "prefill"
            pushed.append(out)
            if out.finished:
                break
        outputs.append(RequestOutput.joined(pushed))
        if i in result.drafted and self.speculator is not None:
            self.speculator.commit(seq, min(len(pushed), len(tokens) - 1), out.finished)
        if out.finished:
            self.scheduler.finish(seq, out.finish_reason, keep_blocks=seq.prefill_only)
            if not seq.prefill_only:
                del self.requests[seq.request_id]

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[dict]:
        """Run prompts to completion; returns per prompt {token_ids, text, finish_reason, logprobs}."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"gen-{id(self)}-{i}" for i in range(len(prompts))]
        results: dict[str, dict[str, Any]] = {
            rid: {"token_ids": [], "text": "", "finish_reason": None, "logprobs": []} for rid in ids}
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        while self.has_unfinished():
            for out in self.step():
                r = results[out.request_id]
                r["token_ids"] += out.new_token_ids
                r["text"] += out.new_text
                if out.logprobs:
                    r["logprobs"] += out.logprobs
                if out.finished:
                    r["finish_reason"] = out.finish_reason
        return [results[rid] for rid in ids]

    # ---- (a) prefill only: KV handed out (KVHandout, kv_handout.py) ---------
    def add_direct_route(self, stream_id: str, route: DirectRoute) -> None:
        """A parallel core: have every rank stream its own KV of request `stream_id` (before it is added)."""
        self.runner.add_route(stream_id, route)

    def drop_direct_route(self, stream_id: str) -> None:
        self.runner.drop_route(stream_id)

    # ---- (b) KV from outside: decode it -----------------------------------
    def reserve(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                group: str | None = None, cache_salt: str | None = None, tenant: str | None = None,
                weight: float = 1.0, priority: int = 0, adapter: str | None = None) -> tuple[Sequence, int]:
        """Allocate blocks for a prompt whose KV will be written from outside.

        Returns the sequence and how many leading tokens are already in the local
        prefix cache under `cache_salt` (their KV need not be sent). Raises NoFreeBlocks when full.
        """
        try:
            seq = self._new_sequence(request_id, prompt, params or SamplingParams(), False, priority, group,
                                     cache_salt, tenant, weight, adapter)
            self._settle_tier()             # (a prefix prefetched from the disk tier: cached now, pinned)
            try:
                cached = self.block_manager.allocate_prompt(seq.table, seq.token_ids, seq.num_tokens)
            except NoFreeBlocks:
                del self.requests[request_id]
                raise
        finally:        # on every exit its prefetch's pins go (a live request's of the same id stay)
            if self.tier is not None:
                self.tier.forget(request_id, prefetch_only=True)
        seq.num_cached_tokens = cached
        seq.status = Status.AWAITING_KV
        if self.speculator is not None:     # a draft model computes its own KV of the prompt while ours arrives
            self.speculator.warm(seq)
        return seq, cached

    def write_kv(self, request_id: str, piece: KVSlice) -> None:
        """Write a slice received from elsewhere into a reserved request's blocks."""
        seq = self.requests[request_id].seq
        slots = self.pool.slots(seq.table.blocks, piece.token_start, piece.token_end)
        for i in range(piece.num_layers):
            self.pool.write(piece.layer + i, slots, piece.k[i], piece.v[i], piece.head_start)
        if self.speculator is not None:
            self.speculator.warm(seq)

    def write_first_layer_kv(self, request_id: str) -> None:
        """Compute layer 0's K/V of a reserved request's uncached prompt tokens here, instead of receiving them
        (shared/kv/transfer.py `EDGE_LAYERS`). A request released or taken over meanwhile needs none."""
        state = self.requests.get(request_id)
        if state is not None and state.seq.status is Status.AWAITING_KV:
            seq = state.seq
            self.runner.write_first_layer_kv(seq, seq.num_cached_tokens, seq.num_prompt_tokens)

    def _check_remote_token(self, token: int, top: list[tuple[int, float]] | None) -> None:
        """A token sampled by another node (a core) must be one of this model's ids before anything uses it:
        an id outside the vocabulary would fail the next step's embedding for the whole batch."""
        vocab = self.config.vocab_size
        if not 0 <= token < vocab or any(not 0 <= t < vocab for t, _ in (top or ())):
            raise RequestError(f"a token from the prefill node is outside the vocabulary [0, {vocab})",
                               param="token")

    def activate(self, request_id: str, first_token: int, logprob: float | None = None,
                 top: list[tuple[int, float]] | None = None, cached_tokens: int | None = None) -> None:
        """The request's KV is complete: record its first token and join the decode batch (`cached_tokens`: the
        prompt tokens the prefilling node did not compute, reported in the request's outputs)."""
        self._check_remote_token(first_token, top)
        state = self.requests[request_id]
        if cached_tokens is not None:
            state.reported_cached = cached_tokens
        seq = state.seq
        seq.num_computed_tokens = seq.num_prompt_tokens
        self._clear_unsent_kv(seq)
        self.block_manager.register_full_blocks(seq.table, seq.token_ids, seq.num_computed_tokens)
        out = state.push(first_token, logprob if seq.params.logprobs is not None else None, top)
        self._pending.append(out)
        if out.finished:
            self.block_manager.free_table(seq.table)
            seq.status = Status.FINISHED
            seq.finish_reason = out.finish_reason
            del self.requests[request_id]
        else:
            seq.status = Status.RUNNING
            self.scheduler.running.append(seq)

    def push_token(self, request_id: str, token: int, logprob: float | None = None,
                   top: list[tuple[int, float]] | None = None, cached_tokens: int | None = None) -> bool:
        """A token decoded elsewhere for a reserved request (AWAITING_KV), in position order: through its
        output rules, emitted with the next step's outputs. True when it finished the request (its blocks
        are freed: the request never decodes here)."""
        state = self.requests.get(request_id)
        if state is None or state.seq.status is not Status.AWAITING_KV:
            raise RequestError(f"request '{request_id}' is not waiting for its KV", param="request_id")
        self._check_remote_token(token, top)
        if cached_tokens is not None:            # the first token's: as `activate`
            state.reported_cached = cached_tokens
        seq = state.seq
        out = state.push(token, logprob if seq.params.logprobs is not None else None, top)
        self._pending.append(out)
        if out.finished:
            self.block_manager.free_table(seq.table)
            seq.status, seq.finish_reason = Status.FINISHED, out.finish_reason
            del self.requests[request_id]
        return out.finished

    def take_pending(self, request_id: str) -> list[RequestOutput]:
        """Remove and return the request's outputs not yet emitted (a pushed token's), for a caller that
        hands them on itself instead of waiting for the next step."""
        mine = [o for o in self._pending if o.request_id == request_id]
        self._pending = [o for o in self._pending if o.request_id != request_id]
        return mine

    def take_over(self, request_id: str, kv_until: int) -> None:
        """Join the decode batch a reserved request that holds valid KV for its tokens [0, kv_until) (at least
        its first token pushed); the rest is computed here before it decodes on."""
        state = self.requests.get(request_id)
        if state is None or state.seq.status is not Status.AWAITING_KV:
            raise RequestError(f"request '{request_id}' is not waiting for its KV", param="request_id")
        seq = state.seq
        if not 0 <= kv_until <= seq.num_prompt_tokens or seq.num_output_tokens < 1:
            raise RequestError(f"cannot take over '{request_id}' with KV until {kv_until} after "
                               f"{seq.num_output_tokens} tokens", param="kv_until")
        seq.num_computed_tokens = kv_until
        if kv_until == seq.num_prompt_tokens:         # the prompt's KV came from a core: windowed layers in part
            self._clear_unsent_kv(seq)
        self.block_manager.register_full_blocks(seq.table, seq.token_ids, kv_until)
        seq.status = Status.RUNNING
        self.scheduler.running.append(seq)

    def _clear_unsent_kv(self, seq: Sequence) -> None:
        """Windowed layers received only the tokens their decode can still see (`needed_from`): zero the
        rest (attention reads whole blocks, and a masked NaN from unwritten memory still poisons a softmax)
        and keep the blocks holding them out of the prefix cache (some layer's KV there is missing)."""
        lo, starts = seq.num_cached_tokens, needed_from(self.config, seq.num_prompt_tokens)
        hi = max(starts)
        if hi <= lo:
            return
        seq.table.uncached_before = hi
        slots = self.pool.slots(seq.table.blocks, lo, hi)
        for layer, start in enumerate(starts):
            if start > lo:
                self.pool.clear(layer, slots[:start - lo])

    # ---- stats ------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        statuses = [s.seq.status for s in self.requests.values()]
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + (self.tier.loading if self.tier is not None else 0),
            prefill_tokens_left=self.scheduler.prefill_tokens_left(),
            prefilled=statuses.count(Status.PREFILLED),
            awaiting_kv=statuses.count(Status.AWAITING_KV),
            requests=len(statuses),
            blocks_total=len(bm.blocks),
            blocks_used=bm.num_used,
            blocks_cached=len(bm.evictable),
            kv_cache_usage=bm.num_used / max(1, len(bm.blocks)),
            prefix_cache_hit_tokens=bm.hits, prefix_cache_query_tokens=bm.queries,
            preemptions=self.scheduler.num_preemptions,
            iteration_tokens=tuple(self.iteration_tokens.counts),
            iteration_tokens_sum=self.iteration_tokens.total,
            prefix_caching=self.cache_config.enable_prefix_caching,
            blocks_touched=bm.touched,
            kv_block_bytes=self.pool.block_bytes,
            weights_bytes=self.weights_bytes,
            compiled_steps=self.runner.compiled_steps,
            **(self.tier.stats() if self.tier is not None else {}),
            **(self.speculator.stats() if self.speculator is not None else {}),
        )

    def close(self) -> None:
        """The engine stops (its thread's last act): the disk tier gets the blocks still cached, then closes."""
        if self.tier is not None:
            self.tier.close()
            self.tier = None
