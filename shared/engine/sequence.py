"""One request's state inside an engine: tokens, progress, blocks, outcome.

Life cycle: WAITING (queued, or preempted back to the queue with its KV
dropped) → RUNNING (scheduled each step; `num_computed_tokens` grows by the
chunk computed) → FINISHED (stop token, stop string, length, abort), or for a
prefill-only request → PREFILLED (first token sampled, KV kept for a reader —
on a core, until the edge's Ack — then released: FINISHED). A request whose KV
comes from elsewhere starts AWAITING_KV (blocks reserved until its KV lands),
then RUNNING once activated, or FINISHED if released.

The tokens still to compute are `token_ids[num_computed_tokens:]`: the prompt
(or its uncached rest) during prefill, then exactly one token per decode step,
so chunked prefill, decode and recompute after preemption share one rule.
"""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING

from edgecore.shared.engine.sampling_params import SamplingParams
from edgecore.shared.kv.block_manager import BlockTable

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from edgecore.shared.engine.output import TokenLogprob
    from edgecore.shared.engine.speculative import DraftStats

_arrival = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREFILLED = "prefilled"          # prefill-only: done, KV kept until released (e.g. waiting for the Ack)
    AWAITING_KV = "awaiting_kv"      # blocks reserved, KV being written from outside, not yet activated
    FINISHED = "finished"


class Sequence:
    # its LoRA adapter (shared/models/lora.py): the name, and the slot the model runner gathers its rows' weights by
    # (0: the base model); set by the engine at admission
    adapter: str | None = None
    lora_slot = 0

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 prefill_only: bool = False, priority: int = 0, group: str | None = None,
                 cache_salt: str | None = None, tenant: str | None = None, weight: float = 1.0):
        self.request_id = request_id
        # the fairness group the scheduler shares the step budget by (the choices of one HTTP request, one
        # batch's line, ...): declared at admission; a request given none is a group of its own
        self.group = request_id if group is None else group
        # the tenant the request belongs to ("" none) and its weight: the scheduler shares a step between the
        # tenants present by weight first, then between each tenant's groups (shared/node/tenants.py)
        self.tenant = tenant or ""
        self.weight = weight
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.prefill_only = prefill_only
        self.priority = priority        # 0 interactive; higher values wait (batch work fills idle capacity)
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0      # prompt tokens served from the prefix cache (first admission)
        self.num_preemptions = 0
        # the prefix cache's scope: blocks are shared only with requests of the same salt (None: unsalted)
        self.cache_salt = cache_salt
        self.table = BlockTable(salt=cache_salt)
        self.arrival = next(_arrival)
        self.finish_reason: str | None = None
        # per prompt position, when asked for (prompt_logprobs.py)
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.grammar: LLMatcher | None = None  # the request's grammar matcher (grammar.py), when it has a `guided` spec
        # speculative decoding (speculative.py): the draft appended to `token_ids` for the step being planned (empty
        # outside one), and the sequence's drafting record (None: it never drafted)
        self.draft: list[int] = []
        self.draft_stats: DraftStats | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.table.blocks)})")
