"""LoRA adapters (PEFT format) served next to the base model, batched Punica/S-LoRA style.

Life cycle: every engine holds a `LoraRegistry` (`LLMEngine.lora`), empty until its first `load` (start-up
`--lora NAME=DIR`, or vLLM's `POST /v1/load_lora_adapter`), which installs one `LayerLora` on each decoder
layer's attention and MLP (`Attention.lora`, `MLP.lora` in shared/models/llama.py, None without adapters).
`read_adapter` checks an adapter against the base model completely before anything changes (config fields,
tensor names, target modules, shapes, rank against `max_rank`: an `AdapterError` naming the first problem;
nothing is half-loaded; shared/models/lora_files.py checks the files, without torch, for a node's start-up flags),
folds the scaling (`lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`) into B and gives the
adapter a slot. Per layer and projection the registry stacks every slot's A and B, stored input-major as the
products read them: A^T [slots, in, R] and B^T [slots, R, out] (slot 0: zeros, the base model; R the largest
rank loaded, smaller ranks zero-padded; the fused q/k/v and gate/up projections stack their parts' ranks side
by side, B block diagonal). Each step the model runner calls `begin(items)`: every row's slot from its
sequence's adapter (`Sequence.lora_slot`, set at admission), rows grouped by adapter; a step with no adapter
row sets nothing and costs one attribute check per projection (and takes the fast decode paths).
`LayerLora.apply` adds the deltas after each base projection: every adapter's rows are gathered [S, G, in]
(padded to the largest group, masked), its A^T and B^T gathered by slot, and two batched matmuls give all
adapters' deltas at once, added back by row index (base rows cost nothing); when one long prefill chunk would
make that padding costly (`PAD_LIMIT`), each adapter's rows take two plain matmuls instead. `end()` clears the
step. `unload` removes the name at once (new requests get a 404); its slot is emptied when no live sequence
uses it any more (`collect`, with the engine's slots in use) and the stacks are rebuilt then. The adapter's
name and content fingerprint are folded into each request's prefix-cache salt (`adapter_salt`), so KV made
under one adapter is never reused under another (also across nodes: an edge's skip_tokens, and the core's
cache, under the same salt).

Scope: the plain Llama-family attention and MLP (Llama, Mistral, Qwen2, Qwen3; the attention of gpt-oss) on
one process (no tensor or pipeline parallelism); PEFT's `bias="none"` only, no DoRA, `modules_to_save`,
`rank_pattern`/`alpha_pattern` or `fan_in_fan_out` (each refused with a message naming it). Loading reads
the files on the engine thread, between steps.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from edgecore.shared.errors import AdapterError, RequestError
from edgecore.shared.models.lora_files import FUSED, MAX_LORA_RANK, check_files, model_shapes

if TYPE_CHECKING:
    from edgecore.shared.models.config import ModelConfig
    from edgecore.shared.models.llama import LlamaForCausalLM

PAD_LIMIT = 2.0             # batched products while adapters × largest group ≤ this × adapter rows (else per group)


@dataclass
class Adapter:
    """One loaded adapter: per (layer index in the checkpoint, projection) A [r, in] and B·scaling [out, r]."""
    name: str
    path: str
    rank: int
    fingerprint: str                        # content hash of its config and weights (16 hex digits)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    slot: int = 0
    unloaded: bool = False

    @property
    def targets(self) -> list[str]:
        return sorted({proj for _, proj in self.weights})


def adapter_salt(cache_salt: str | None, adapter: Adapter | None) -> str | None:
    """The prefix-cache salt of a request under `adapter`: the adapter's name and fingerprint ‖ US ‖ its own salt
    (no separator without one, so a salt of "" stays apart from none; no adapter: the salt as given)."""
    return cache_salt if adapter is None else scope_salt(cache_salt, adapter.name, adapter.fingerprint)


def scope_salt(cache_salt: str | None, name: str, fingerprint: str) -> str:
    """`adapter_salt` from the adapter's name and fingerprint alone (an edge predicting a core's cache hits)."""
    own = "" if cache_salt is None else "\x1f" + cache_salt
    return f"lora:{name}:{fingerprint}{own}"


def _plain_modules(model: LlamaForCausalLM) -> tuple[bool, bool]:
    """Whether every layer's attention, and every layer's MLP, is llama.py's own (where LoRA applies)."""
    from edgecore.shared.models.llama import MLP, Attention, DecoderLayer
    layers = [cast(DecoderLayer, layer) for layer in model.model.layers]
    attn = all(type(layer.self_attn).forward is Attention.forward and hasattr(layer.self_attn, "qkv_proj")
               for layer in layers)
    mlp = all(type(layer.mlp).forward is MLP.forward for layer in layers)
    return attn, mlp


def read_adapter(name: str, path: str | Path, model: LlamaForCausalLM, max_rank: int = MAX_LORA_RANK) -> Adapter:
    """A checked adapter in the model's dtype and device, or an AdapterError naming the first problem."""
    from edgecore.shared.models.parallel import tensor_parallel
    if tensor_parallel().size > 1:
        raise AdapterError("LoRA adapters need a node on one tensor-parallel rank (--tp 1)")
    param = next(model.parameters())
    return check_adapter(name, path, model.config, max_rank, _plain_modules(model), param.dtype, param.device)


def check_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int = MAX_LORA_RANK,
                  plain: tuple[bool, bool] = (True, True), dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> Adapter:
    """`read_adapter` against a model's config alone (`plain`: whether its attention and MLP are the plain
    Llama-family ones): shared/models/lora_files.py `check_files`, then the tensors read."""
    from safetensors import SafetensorError, safe_open
    files = check_files(name, path, config, max_rank, plain)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    try:
        with safe_open(str(files.weights_file), framework="pt") as f:
            for (layer, proj), (a_key, b_key) in files.pairs.items():
                a, b = f.get_tensor(a_key), f.get_tensor(b_key)
                weights[(layer, proj)] = (a.to(device, dtype).contiguous(),
                                          (b.double() * files.scaling).to(device, dtype).contiguous())
    except SafetensorError as exc:
        raise AdapterError(f"{files.weights_file}: not a readable safetensors file ({exc})") from None
    digest = hashlib.sha256(files.raw_config)
    with open(files.weights_file, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return Adapter(name, str(Path(path)), files.rank, digest.hexdigest()[:16], weights)


class LoraStep:
    """The current step's adapter rows (`active`: none when False), grouped by adapter: `slots` [S] the adapters
    present, `index` [S, G] each one's rows (padded with row 0, `mask` [S, G, 1] zero there; None: no padding),
    and the same groups as (rows: a range or their indices, slot) for the per-group path (`batched` False)."""
    active = False
    batched = True
    slots: torch.Tensor | slice             # a slice when the adapters present are consecutive slots (no copy)
    index: torch.Tensor
    mask: torch.Tensor | None = None
    groups: list[tuple[slice | torch.Tensor, int]]

    def __init__(self) -> None:
        self.groups = []


class LayerLora:
    """One layer's stacks: fused projection name → (A^T [slots, in, R], B^T [slots, R, out]), input-major as the
    products read them."""

    def __init__(self, step: LoraStep) -> None:
        self.step = step
        self.stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def apply(self, proj: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base projection of `x`) plus each adapter row's delta x A^T B^T (base rows: nothing)."""
        step = self.step
        stack = self.stacks.get(proj) if step.active else None
        if stack is None:
            return y
        a, b = stack
        if step.batched:    # every adapter's rows gathered [S, G, in], its A^T and B^T gathered: two bmm for all
            d = torch.bmm(torch.bmm(x[step.index], a[step.slots]), b[step.slots])
            if step.mask is not None:
                d.mul_(step.mask)
            return y.index_add_(0, step.index.view(-1), d.view(-1, d.shape[-1]))
        for where, slot in step.groups:        # uneven groups (a long prefill chunk): one adapter at a time
            if isinstance(where, slice):
                y[where].add_(torch.mm(torch.mm(x[where], a[slot]), b[slot]))
            else:
                y.index_add_(0, where, torch.mm(torch.mm(x.index_select(0, where), a[slot]), b[slot]))
        return y


class LoraRegistry:
    """The adapters an engine serves: names, slots, stacked weights, the step's rows (engine thread only)."""

    def __init__(self, model: LlamaForCausalLM, in_use: Callable[[], Iterable[int]] = tuple,
                 one_process: Callable[[], bool] = lambda: True, max_rank: int = MAX_LORA_RANK) -> None:
        """`in_use`: the slots of the engine's live requests (a slot is emptied only when none uses it);
        `one_process`: False on a parallel (TP/PP) engine, which takes no adapter."""
        self.model = model
        self.in_use = in_use
        self.one_process = one_process
        self.max_rank = max_rank
        self.by_name: dict[str, Adapter] = {}
        self.slots: list[Adapter | None] = [None]      # slot 0: the base model
        self.step = LoraStep()
        self.layers = [LayerLora(self.step) for _ in model.model.layers]

    def install(self) -> None:
        """Hang each layer's stacks on its attention and MLP (after the first adapter loaded)."""
        from edgecore.shared.models.llama import MLP, Attention, DecoderLayer
        for module, lora in zip(self.model.model.layers, self.layers):
            layer = cast(DecoderLayer, module)
            if isinstance(layer.self_attn, Attention):    # (other attentions and MoE MLPs take no adapter: `_plain_modules`)
                layer.self_attn.lora = lora
            if isinstance(layer.mlp, MLP):
                layer.mlp.lora = lora

    def get(self, name: str) -> Adapter | None:
        return self.by_name.get(name)

    def resolve(self, name: str | None) -> Adapter | None:
        """The adapter a request names (None: the base model); a RequestError (a 404) when none is loaded so."""
        if name is None:
            return None
        adapter = self.by_name.get(name)
        if adapter is None:
            raise RequestError(f"The model '{name}' does not exist.", "model", "model_not_found")
        return adapter

    def names(self) -> list[str]:
        return list(self.by_name)

    def fingerprints(self) -> dict[str, str]:
        """Loaded adapters: name → fingerprint."""
        return {a.name: a.fingerprint for a in self.by_name.values()}

    def load(self, name: str, path: str | Path) -> Adapter:
        """Read, check and add an adapter (AdapterError: nothing changed)."""
        return self.add(self.read(name, path))

    def read(self, name: str, path: str | Path) -> Adapter:
        """Read and check an adapter, changing nothing: file reads and hashing, safe off the engine thread (a slow
        disk or a FIFO then blocks no step); `add` it on the engine thread."""
        if not self.one_process():
            raise AdapterError("LoRA adapters are served by a node on one process (no --tp/--pp)")
        if name in self.by_name:
            raise AdapterError(f"The lora adapter '{name}' has already been loaded", "lora_name")
        return read_adapter(name, path, self.model, self.max_rank)

    def add(self, adapter: Adapter) -> Adapter:
        """Give a read adapter a slot and rebuild the stacks (AdapterError: nothing changed)."""
        name = adapter.name
        if name in self.by_name:            # (loaded meanwhile, by another call)
            raise AdapterError(f"The lora adapter '{name}' has already been loaded", "lora_name")
        if len(self.slots) == 1:
            self.install()          # the first adapter: the layers get their (empty until rebuilt) stacks
        self.collect(rebuild=False)
        free = [i for i in range(1, len(self.slots)) if self.slots[i] is None]
        adapter.slot = free[0] if free else len(self.slots)
        slots = list(self.slots)
        if adapter.slot == len(slots):
            slots.append(adapter)
        else:
            slots[adapter.slot] = adapter
        self._rebuild(slots)        # may raise (memory): the registry is unchanged then
        self.slots = slots
        self.by_name[name] = adapter
        return adapter

    def unload(self, name: str) -> Adapter:
        """Stop serving `name` (AdapterError if it is not loaded); requests running on it finish with it."""
        adapter = self.by_name.pop(name, None)
        if adapter is None:
            raise AdapterError(f"The lora adapter '{name}' cannot be found", "lora_name")
        adapter.unloaded = True
        self.collect()
        return adapter

    def collect_pending(self) -> None:
        """`collect` when an unloaded adapter still holds a slot (the engine calls it as requests end: an adapter
        unloaded while requests ran on it is freed when the last of them finishes, not at the next load/unload)."""
        if any(a is not None and a.unloaded for a in self.slots):
            self.collect()

    def collect(self, rebuild: bool = True) -> None:
        """Empty the slots of unloaded adapters no live sequence uses any more."""
        busy = set(self.in_use())
        freed = False
        for i, adapter in enumerate(self.slots):
            if adapter is not None and adapter.unloaded and i not in busy:
                self.slots[i] = None
                freed = True
        while len(self.slots) > 1 and self.slots[-1] is None:
            self.slots.pop()
        if freed and rebuild:
            self._rebuild(self.slots)

    def _rebuild(self, slots: list[Adapter | None]) -> None:
        """Stack every slot's A and B per layer and fused projection (built aside, then swapped in)."""
        shapes = model_shapes(self.model.config)
        param = next(self.model.parameters())
        new: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for global_layer in self.model.model.layer_ids:
            stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            for fused, parts in FUSED.items():
                # each part's rank columns: the largest rank any adapter gives it in this layer
                ranks = [max((a.weights[(global_layer, p)][0].shape[0] for a in slots
                              if a is not None and (global_layer, p) in a.weights), default=0) for p in parts]
                total = sum(ranks)
                if not total:
                    continue
                fan_in = shapes[parts[0]][0]
                outs = [shapes[p][1] for p in parts]
                a_stack = torch.zeros(len(slots), total, fan_in, dtype=param.dtype, device=param.device)
                b_stack = torch.zeros(len(slots), sum(outs), total, dtype=param.dtype, device=param.device)
                for s, adapter in enumerate(slots):
                    if adapter is None:
                        continue
                    col, row = 0, 0
                    for p, rank, out in zip(parts, ranks, outs):
                        pair = adapter.weights.get((global_layer, p))
                        if pair is not None:
                            a, b = pair
                            a_stack[s, col:col + a.shape[0]] = a
                            b_stack[s, row:row + out, col:col + a.shape[0]] = b
                        col, row = col + rank, row + out
                stacks[fused] = (a_stack.transpose(1, 2).contiguous(), b_stack.transpose(1, 2).contiguous())
            new.append(stacks)
        for lora, stacks in zip(self.layers, new):
            lora.stacks = stacks

    # ---- per step ----------------------------------------------------------------------------------
    def begin(self, items: Iterable[tuple[Any, int]]) -> bool:
        """Set the step's rows from its (sequence, tokens) items in row order; False (nothing set) when no
        row has an adapter."""
        if len(self.slots) == 1:       # no adapter loaded: nothing to look at
            return False
        spans: dict[int, list[tuple[int, int]]] = {}       # slot → its rows' ranges, merged when adjacent
        row = 0
        for seq, n in items:
            slot = getattr(seq, "lora_slot", 0)
            if slot:
                ranges = spans.setdefault(slot, [])
                if ranges and ranges[-1][1] == row:
                    ranges[-1] = (ranges[-1][0], row + n)
                else:
                    ranges.append((row, row + n))
            row += n
        if not spans:
            return False
        spans = dict(sorted(spans.items()))
        step = self.step
        device = next(self.model.parameters()).device
        members = [[r for lo, hi in ranges for r in range(lo, hi)] for ranges in spans.values()]
        widest, rows = max(map(len, members)), sum(map(len, members))
        step.active, step.batched = True, len(members) * widest <= PAD_LIMIT * rows
        if step.batched:
            present = list(spans)
            step.slots = slice(present[0], present[-1] + 1) if present == list(range(present[0], present[-1] + 1)) \
                else torch.tensor(present, dtype=torch.long, device=device)
            step.index = torch.tensor([m + [0] * (widest - len(m)) for m in members], dtype=torch.long, device=device)
            step.mask = None if widest * len(members) == rows else torch.tensor(
                [[1.0] * len(m) + [0.0] * (widest - len(m)) for m in members], device=device,
                dtype=next(self.model.parameters()).dtype).unsqueeze(2)
        else:
            step.groups = [(slice(*ranges[0]) if len(ranges) == 1 else torch.tensor(m, device=device), slot)
                           for (slot, ranges), m in zip(spans.items(), members)]
        return True

    def end(self) -> None:
        self.step.active = False
        self.step.groups = []
