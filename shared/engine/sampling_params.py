"""Per-request sampling parameters, validated once when a request is created.

Field names and meanings follow vLLM / OpenAI: `temperature` 0 means greedy, and so does any
temperature under `GREEDY_BELOW` (as vLLM: the limit of sampling as T → 0 is the argmax, while logits
divided by a temperature near float32's smallest normal overflow to inf and would sample garbage);
`top_k` ≤ 0 disables top-k; `min_p` drops tokens below `min_p` × the top
probability; `presence_penalty` / `frequency_penalty` apply to the output
tokens, `repetition_penalty` to prompt and output tokens (divides positive
logits, multiplies negative ones); `logit_bias` adds to token ids' logits; `logprobs`
is how many top alternatives to return beside the chosen token's logprob (None:
no logprobs); `prompt_logprobs` the same for each prompt token (None: none);
`detokenize=False` returns token ids only (no text, so no stop strings either);
`guided` constrains the output to a grammar (`grammar.py`).
Validation is one msgspec conversion against `_Checked`: a bad value raises
`RequestError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta

from edgecore.shared.errors import RequestError

if TYPE_CHECKING:
    from edgecore.protocol.messages import SamplingSpec

MAX_LOGPROBS = 20
# What decides a request's first token: the fields a prefill on another node needs (protocol SamplingSpec).
GREEDY_BELOW = 1e-5    # temperatures below this sample greedily

SPEC_FIELDS = ("temperature", "top_p", "top_k", "seed", "logprobs", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "logit_bias", "min_p")


class GuidedSpec(msgspec.Struct, frozen=True):
    """What a request's output must match (`grammar.py` compiles it): a JSON schema (as JSON text), any JSON
    object, a regex, one of several strings (`value`: a JSON list) or a Lark grammar. `param` names the
    request field it came from, for errors."""
    kind: Literal["json_schema", "json_object", "regex", "choice", "lark"]
    value: str = ""
    param: str = "response_format"


class _Checked(msgspec.Struct):
    max_tokens: Annotated[int, Meta(ge=1)]
    temperature: Annotated[float, Meta(ge=0, le=100)]
    top_p: Annotated[float, Meta(gt=0, le=1)]
    top_k: int
    seed: Annotated[int, Meta(ge=-(2 ** 63), le=2 ** 63 - 1)] | None
    stop: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(max_length=16)]
    stop_token_ids: list[Annotated[int, Meta(ge=0)]]
    ignore_eos: bool
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None
    include_stop_str_in_output: bool
    detokenize: bool
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)]
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)]
    repetition_penalty: Annotated[float, Meta(ge=0.01, le=100)]   # beyond: logits overflow float32
    logit_bias: dict[Annotated[int, Meta(ge=0)], Annotated[float, Meta(ge=-100, le=100)]] | None
    min_p: Annotated[float, Meta(ge=0, le=1)]
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None
    guided: GuidedSpec | None


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
    prompt_logprobs: int | None = None
    guided: GuidedSpec | None = None       # structured output (grammar.py); such requests decode where they prefill

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this request's logits before choosing (penalties, biases)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    def spec_fields(self) -> dict[str, Any]:
        """The `SPEC_FIELDS` as keyword arguments of the protocol's `SamplingSpec`."""
        fields = {name: getattr(self, name) for name in SPEC_FIELDS}
        fields["logit_bias"] = dict(self.logit_bias or {})
        return fields

    @classmethod
    def from_spec(cls, spec: SamplingSpec, **kw: Any) -> SamplingParams:
        """Parameters from a protocol `SamplingSpec` (validated like any others), plus `kw`."""
        fields = {name: getattr(spec, name) for name in SPEC_FIELDS}
        fields["logit_bias"] = dict(fields["logit_bias"]) or None
        return cls(**fields, **kw)

    def validate(self) -> None:
        try:
            msgspec.convert(self, _Checked, from_attributes=True)
        except msgspec.ValidationError as exc:
            text = str(exc)
            name = text.rsplit("`$.", 1)[-1].split("[", 1)[0].rstrip("`") if "`$." in text else None
            raise RequestError(f"'{name}': {text}" if name else text, param=name) from None
        if self.stop and not self.detokenize:
            raise RequestError("'stop' needs detokenized text: stop strings cannot be used with "
                               "detokenize=False", param="stop")
