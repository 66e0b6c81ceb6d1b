"""Hugging Face models with no hand-written family, split from the model's own structure and code: decoder-only
causal LMs (OPT, Mistral, Qwen2/3, GPT-NeoX, Phi, Gemma 1/3, Falcon, BLOOM, GPT-J, MPT, OLMo, StableLM, ...) and
encoders (RoBERTa, ELECTRA, DistilBERT, ...) with every head Hugging Face has for them: masked LM, sequence
classification (single-label, regression, multi-label), token classification, question answering (``[batch, seq,
2]`` start / end logits), multiple choice (one layer: it flattens the choices in its top-level forward); image
encoders (``pixel_values``: DeiT, ConvNeXt (one layer per stage), CLIP's image classifier) and audio encoders
(``input_values`` / ``input_features``: Wav2Vec2 CTC, Whisper's audio classifier). The probe batch is built from the
config (vocabulary, image size and channels, the feature extractor's kernels and strides, mel bins). A contrastive
loss over the whole batch (``CLIPModel``) does not decompose over micro-batches and is refused.

:func:`generic_family` is what :func:`~uniap_lightning.adapters.auto.pretrained_chain` falls back to when
:data:`~uniap_lightning.adapters.auto.FAMILIES` has no builder for ``config.model_type`` (a hand-written family
always wins). The chain is

* the *prologue*: the base model's own forward on the batch (``input_ids``, ``attention_mask``, ...), stopped where
  it calls its first block. The blocks' ``forward`` are replaced by recorders for that call, so what the model
  passes each block (hidden states, causal or bidirectional + padding masks, rotary ``(cos, sin)``, position ids,
  ALiBi, flags) is recorded with the model's own code, whatever the family. The prologue returns the hidden states
  and the distinct tensors the blocks take (``uniap_ctx<j>``) as a dict payload; the non-tensor arguments
  (``use_cache=False``, ``None`` caches) are constants of each block layer;
* one layer per block (the ``nn.ModuleList`` of same-class modules holding most parameters): ``block(hidden,
  **its recorded arguments)``, its first output the new hidden states;
* the *epilogue*: the outermost modules the model runs after its last block, in the order it runs them (final norm,
  projection, LM head; an encoder's head module) -> logits, with the pooling a head does in its top-level forward
  (first token, mean over the sequence or the feature map) found on the probe batch; the model's own loss (the
  head's), whole-batch normalized like the hand-written families (each head's loss, counts and labels:
  :mod:`.generic_heads`); for a mixture-of-experts causal LM trained with ``output_router_logits=True``, plus the
  routers' load-balancing term, rebuilt from per-sample statistics the blocks carry (:mod:`.generic_router`).

Payload tensors carry the batch on dim 0: a tensor the model broadcasts over the batch (a ``[1, seq, dim]`` rotary
table) is expanded and taken back as one row, one independent of the batch is sent per row and taken back once, one
holding ``k`` rows per sample (ALiBi's ``[batch * heads, ...]``) is sent as ``[batch, k, ...]``; which is which is
learned from two probes of different batch sizes at setup. Attention runs as SDPA with masks always materialized
(``uniap_sdpa``: SDPA whose mask function never skips the mask), so every batch has the same payload structure; the
4-D boolean mask (``batch x seq x seq`` bytes) crosses each stage boundary.

At setup the chain is checked on a probe batch against the model's own forward (logits and loss, the batch split
into two micro-batches). A model this cannot reproduce (logits changed in the top-level forward, a shared block run
several times, pooling outside a module) trains as one layer (:class:`WholeModel`: replicated or ZeRO, one
warning naming why) when its own loss is the one the chain computes; anything else is refused with a
:class:`~uniap_lightning.errors.UniAPError` naming why, never trained wrong.
"""
from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from uniap_lightning.adapters.auto import Family, HFTarget
from uniap_lightning.adapters.families.common import colwise, divisors_of_all, replicate, rowwise
from uniap_lightning.adapters.families.generic_heads import _CLASSIFY, _HEADS, _TASKS, _ctc_loss, _Task, count_one
from uniap_lightning.adapters.families.generic_router import (
    ROUTER,
    TOKEN_MASK,
    RouterLoss,
    caught_logits,
    router_loss_of,
    router_modules,
)
from uniap_lightning.adapters.families.text import _last_non_padding
from uniap_lightning.errors import UniAPError

#: the attention implementation the generic layers run with (SDPA, masks always materialized)
ATTENTION = "uniap_sdpa"
_PREFIX = "uniap_ctx"
_CONSTANTS = (type(None), bool, int, float, str)


class _Stop(Exception):
    """Raised by the last block's recorder: the prologue has what it needs."""


@dataclass(frozen=True)
class _Ref:
    """Where a block takes payload tensor ``index``."""

    index: int


_HIDDEN = "<hidden>"


def _register_attention() -> bool:
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # pragma: no cover - an older transformers
        return False

    def mask(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_is_causal_skip"] = False  # a mask every time (None without padding would change the payload)
        kwargs["allow_is_bidirectional_skip"] = False
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(ATTENTION, sdpa_attention_forward)
    AttentionMaskInterface.register(ATTENTION, mask)
    return True


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (no dropout on the probes), each module's own mode restored after."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for m, training in modes.items():
            m.train(training)


def _accept_one_layer(model: Any, task: _Task, logits: torch.Tensor, labels: torch.Tensor, reference: Any,
                      why: UniAPError) -> list[str]:
    """The one-layer fallback's check and warning: the model's own loss must be ``task``'s loss of its logits (else
    ``why`` is raised); returns the top-level modules the layer owns."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    try:
        _check_loss(model, task, logits, labels, reference, 1e-4)
    except UniAPError:
        raise why from None
    reason = getattr(why, "reason", "") or str(why)
    rank_zero_warn(f"{type(model).__name__} trains as ONE layer (replicated or ZeRO-sharded, no pipeline or tensor "
                   f"parallelism): the generic split cannot handle it ({reason}). Define uniap_layers() on your "
                   "LightningModule to split it.")
    return [n for n, m in model.named_children() if any(True for _ in m.parameters())]


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


class Unsplittable(UniAPError):
    """A model the generic split cannot handle; ``reason`` says why."""

    reason = ""


def _refuse(model: Any, why: str) -> UniAPError:
    from uniap_lightning.adapters.auto import FAMILIES

    error = Unsplittable(
        f"{type(model).__name__} (model_type={getattr(model.config, 'model_type', None)!r}) is not a Hugging Face "
        f"family the strategy can split: no hand-written family (those: {sorted(FAMILIES)}) and the generic split "
        f"cannot handle it: {why}. Implement uniap_layers() on your LightningModule returning the model's layers in "
        "order (each taking and returning a tensor, a tuple or a dict of tensors), with uniap_loss(output, target) "
        "and, for dict batches, uniap_split_batch(batch); see uniap_lightning.runtime.chain"
    )
    error.reason = why
    return error


# ------------------------------------------------------------------------------------------------------ structure
def _find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ``nn.ModuleList`` of same-class modules holding the most parameters."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) == 0 or len({type(c) for c in m}) != 1:
            continue
        size = sum(p.numel() for p in m.parameters())
        if size and (best is None or size > best[0]):
            best = (size, name, m)
    if best is None:
        raise _refuse(model, "it has no nn.ModuleList of repeated blocks")
    return best[1], best[2]


def _units(model: nn.Module, blocks_name: str) -> dict[str, nn.Module]:
    """The modules outside the blocks a layer can hold: leaves and modules owning parameters directly."""
    out = {}
    for name, m in model.named_modules():
        if name == blocks_name or name.startswith(blocks_name + "."):
            continue
        if any(True for _ in m.parameters(recurse=False)) or not any(True for _ in m.children()):
            out[name] = m
    return out


class _Calls:
    """Hooks recording the order in which modules run, and which run before / after the blocks."""

    def __init__(self, units: dict[str, nn.Module], blocks: nn.ModuleList) -> None:
        self.order: list[tuple[str, str]] = []  # (phase, name) of each first call per phase
        self.phase = "before"
        names = {id(m): n for n, m in units.items()}
        self.handles = [m.register_forward_pre_hook(self._pre(names[id(m)])) for m in units.values()]
        self.handles.append(blocks[0].register_forward_pre_hook(lambda *_: self._set("between")))
        self.handles.append(blocks[-1].register_forward_hook(lambda *_: self._set("after")))

    def _set(self, phase: str) -> None:
        self.phase = phase

    def _pre(self, name: str) -> Any:
        def hook(*_: Any) -> None:
            if (self.phase, name) not in self.order:
                self.order.append((self.phase, name))
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def names(self, phase: str) -> list[str]:
        return [n for p, n in self.order if p == phase]


#: a module's hook tables (emptied on the blocks while the prologue records)
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
          "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


def _capture(base: nn.Module, blocks: nn.ModuleList, inputs: dict[str, Any]) -> tuple[torch.Tensor, list[Any]]:
    """The base model's forward up to its blocks: (hidden states block 0 takes, ``(args, kwargs)`` of each block)."""
    calls: list[tuple[tuple, dict]] = []
    saved = [b.__dict__.get("forward") for b in blocks]

    def recorder(i: int) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            calls.append((args, kwargs))
            if i == len(blocks) - 1:
                raise _Stop
            return args[0] if args else kwargs.get("hidden_states")
        return forward

    # the blocks' own hooks stay out of it (FSDP would gather a block's weights for a call that never runs it)
    hooks = [{k: v for k, v in b.__dict__.items() if k in _HOOKS} for b in blocks]
    for i, b in enumerate(blocks):
        b.forward = recorder(i)
        for k, v in hooks[i].items():
            setattr(b, k, type(v)())
    try:
        base(**inputs)
    except _Stop:
        pass
    finally:
        for b, f, h in zip(blocks, saved, hooks):
            del b.forward
            if f is not None:
                b.forward = f
            for k, v in h.items():
                setattr(b, k, v)
    if len(calls) != len(blocks):
        raise UniAPError(f"the model's forward called {len(calls)} of its {len(blocks)} blocks")
    args, kwargs = calls[0]
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        raise UniAPError("its first block does not take the hidden states first (or as hidden_states=)")
    return hidden, calls


def _templates(calls: list[Any]) -> tuple[list[Any], list[torch.Tensor]]:
    """Each block's ``(args, kwargs)`` with the hidden states and the tensors replaced by markers, and the distinct
    tensors (by identity, in order of first use)."""
    tensors: list[torch.Tensor] = []
    seen: dict[int, int] = {}

    def mark(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if id(v) not in seen:
                seen[id(v)] = len(tensors)
                tensors.append(v)
            return _Ref(seen[id(v)])
        if isinstance(v, (tuple, list)):
            return tuple(mark(x) for x in v)
        if not isinstance(v, _CONSTANTS):
            raise UniAPError(f"it passes its blocks a {type(v).__name__}, which cannot travel between stages")
        return v

    out = []
    for args, kwargs in calls:
        if args:
            a = (_HIDDEN, *[mark(x) for x in args[1:]])
            k = {n: mark(v) for n, v in kwargs.items()}
        else:
            a = ()
            k = {n: (_HIDDEN if n == "hidden_states" else mark(v)) for n, v in kwargs.items()}
        out.append((a, k))
    return out, tensors


def _fill(t: Any, hidden: torch.Tensor, values: dict[int, torch.Tensor]) -> Any:
    if isinstance(t, _Ref):
        return values[t.index]
    if isinstance(t, str) and t == _HIDDEN:
        return hidden
    if isinstance(t, tuple):
        return tuple(_fill(x, hidden, values) for x in t)
    return t


def _refs(t: Any) -> set[int]:
    if isinstance(t, _Ref):
        return {t.index}
    if isinstance(t, tuple):
        return set().union(*[_refs(x) for x in t]) if t else set()
    if isinstance(t, dict):
        return _refs(tuple(t.values()))
    return set()


def _mode(model: Any, j: int, small: torch.Tensor, large: torch.Tensor) -> tuple[str, int]:
    """How payload tensor ``j`` holds the batch, from its dim 0 with batches of 2 and 3 samples."""
    if small.dim() == 0 or large.dim() == 0:
        return "constant", 1
    rows2, rows3 = small.shape[0], large.shape[0]
    if rows2 == 1 and rows3 == 1:
        return "broadcast", 1
    if rows2 % 2 == 0 and rows3 % 3 == 0 and rows2 // 2 == rows3 // 3:
        return "rows", rows2 // 2
    if rows2 == rows3:
        return "constant", 1
    raise _refuse(model, f"its blocks take a tensor with {rows2} rows for 2 samples and {rows3} for 3")


@dataclass
class _Plan:
    """What the prologue sends and how each block takes it back."""

    templates: list[Any]
    modes: list[tuple[str, int]]

    def encode(self, tensors: list[torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
        out = {}
        for j, (t, (mode, k)) in enumerate(zip(tensors, self.modes)):
            if mode == "constant":
                t = t.unsqueeze(0).expand(rows, *t.shape)
            elif t.shape[0] == 1 and k == 1:
                t = t.expand(rows, *t.shape[1:])
            elif mode == "rows" and t.shape[0] == rows * k:
                t = t.reshape(rows, k, *t.shape[1:]) if k > 1 else t
            else:
                raise UniAPError(f"the model passes its blocks a tensor of shape {tuple(t.shape)} for {rows} samples "
                                 f"(at setup: {mode}, {k} rows per sample)")
            out[f"{_PREFIX}{j}"] = t
        return out

    def decode(self, d: dict[str, torch.Tensor], indices: set[int], rows: int) -> dict[int, torch.Tensor]:
        out = {}
        for j in indices:
            x, (mode, k) = d[f"{_PREFIX}{j}"], self.modes[j]
            if mode == "constant":
                x = x[0]
            elif mode == "broadcast":
                x = x[:1]
            elif k > 1:
                x = x.reshape(rows * k, *x.shape[2:])
            out[j] = x
        return out


# ------------------------------------------------------------------------------------------------------ layers
class _Layer(nn.Module):
    """A view over modules of the user's model, registered under neutral names (their names in the LightningModule
    stay the model's own)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.units = nn.ModuleList(modules)

    def uniap_tp_degrees(self) -> list[int]:
        return [1]


class GenericPrologue(_Layer):
    """The base model's forward up to its first block: hidden states + what the blocks take. Tensor parallel over
    the vocabulary when the token embedding is a plain ``nn.Embedding`` (output all-reduced)."""

    def __init__(self, modules: list[nn.Module], base: nn.Module, blocks: nn.ModuleList, plan: _Plan,
                 extra: dict[str, Any], inputs: tuple[str, ...], embedding: nn.Module | None = None) -> None:
        super().__init__(modules)
        # not registered: the base model holds every layer's modules
        self.__dict__["_base"], self.__dict__["_blocks"] = base, blocks
        self.plan, self.extra, self.inputs = plan, extra, inputs
        self.embedding = next((i for i, m in enumerate(modules) if m is embedding and type(m) is nn.Embedding), None)
        #: ``(pad_token_id,)`` when the head pools at each row's last non-padding token: the prologue (which alone
        #: sees ``input_ids``) sends that index on as ``uniap_last``
        self.last: tuple[int | None] | None = None
        #: the load-balancing term the loss adds (:mod:`.generic_router`): the prologue starts its accumulator and
        #: sends the token mask on
        self.router: RouterLoss | None = None

    def uniap_tp_degrees(self) -> list[int]:
        if self.embedding is None:
            return [1]
        return divisors_of_all(self.units[self.embedding].num_embeddings)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        assert self.embedding is not None
        return {f"units.{self.embedding}": rowwise(input_layouts=replicate(), output_layouts=replicate())}

    def uniap_tp_allreduces(self) -> int:
        return 1 if self.embedding is not None else 0

    def forward(self, d: dict[str, torch.Tensor]) -> dict[str, Any]:
        batch = {k: d[k] for k in self.inputs if k in d}
        if "attention_mask" in self.inputs and "attention_mask" not in batch and self.inputs[0] in _MASKED:
            # all ones, as the model reads a missing mask: the blocks take what they took on the (masked) probe
            main = batch[self.inputs[0]]
            batch["attention_mask"] = torch.ones(main.shape[:2], dtype=torch.long, device=main.device)
        hidden, calls = _capture(self._base, self._blocks, {**batch, **self.extra})
        templates, tensors = _templates(calls)
        if templates != self.plan.templates:
            raise UniAPError("the model passed its blocks other arguments than on the setup probe; the generic split "
                             "needs the same structure for every batch")
        rows = hidden.shape[0]
        last = {} if self.last is None else {_LAST: _last_non_padding(d["input_ids"], self.last[0])}
        if self.router is not None:
            mask = batch.get("attention_mask")
            mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device) if mask is None else mask
            last.update({ROUTER: torch.zeros(rows, 2 * self.router.experts, device=hidden.device),
                         TOKEN_MASK: mask})
        return {**{k: None for k in self.inputs}, "hidden": _settled(hidden).contiguous(),
                **self.plan.encode(tensors, rows), **last}


def _settled(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor: the output of a tensor-parallel embedding (its all-reduce still in flight, a
    storage-less ``AsyncCollectiveTensor``) waited for, as layers after it and the data-parallel hooks expect."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.clone() if isinstance(t, AsyncCollectiveTensor) else t


class _ContiguousGrad(torch.autograd.Function):
    """Identity; its gradient made contiguous (a convolution's input gradient can come out channels-last, and a
    pipeline stage receives gradients into buffers laid out like the activations it sent)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(x) if x.requires_grad and x.dim() > 3 else x


_ATTENTION_OUT = ("o_proj", "dense", "out_proj")
_MLPS = ((("gate_proj", "up_proj"), "down_proj"), (("fc1",), "fc2"), (("up_proj",), "down_proj"),
         (("dense_h_to_4h",), "dense_4h_to_h"))
#: fused query / key / value projections laid out per head (``[heads, 3 * head_dim]``: a contiguous slice of the
#: output features is whole heads with their q, k and v), recognized by the reshape in the attention's forward
_FUSED = (("query_key_value", "dense", "(*input_shape,-1,3*self.head_size)"),)  # GPT-NeoX


def _linear(m: nn.Module, name: str) -> bool:
    return isinstance(getattr(m, name, None), nn.Linear)


def _others(module: nn.Module, linears: tuple[str, ...]) -> bool:
    """Whether ``module`` holds parameters outside its ``linears``."""
    inside = {id(p) for n in linears for p in getattr(module, n).parameters()}
    return any(id(p) not in inside for p in module.parameters())


def _tensor_parallel(block: nn.Module, config: Any) -> tuple[dict[str, str], list[int]] | None:
    """Megatron-style tensor parallelism of a block with separate query / key / value projections (or a fused one
    laid out per head, :data:`_FUSED`) and an MLP of known names: ``({path: "col" | "row"}, degrees)``; ``None``
    when the block is not recognized (Falcon's fused QKV reshaped with its full head count, an attention that
    reshapes with its full head count, ...)."""
    separate = [(n, m, ("q_proj", "k_proj", "v_proj"), next(o for o in _ATTENTION_OUT if _linear(m, o)),
                 "(*input_shape,-1,self.head_dim)") for n, m in block.named_modules()
                if all(_linear(m, p) for p in ("q_proj", "k_proj", "v_proj"))
                and any(_linear(m, o) for o in _ATTENTION_OUT)]
    fused = [(n, m, (qkv,), out, shape) for n, m in block.named_modules() for qkv, out, shape in _FUSED
             if _linear(m, qkv) and _linear(m, out)]
    attention = separate + fused
    if len(attention) != 1:
        return None
    name, attn, projections, out, shape = attention[0]
    try:
        source = "".join(inspect.getsource(type(attn).forward).split())
    except (OSError, TypeError):
        return None
    # the heads come from the projections' width (``-1`` heads), so each rank runs its own whole heads
    if shape not in source or "reshape(*input_shape,-1)" not in source:
        return None
    if _others(attn, (*projections, out)):
        return None  # e.g. Qwen3's per-head query / key norms: replicated weights seeing only this rank's heads
    prefix = f"{name}." if name else ""
    plan = {**{f"{prefix}{p}": "col" for p in projections}, f"{prefix}{out}": "row"}
    mlps = []
    for n, m in block.named_modules():
        found = next(((c, r) for c, r in _MLPS if m is not attn and all(_linear(m, x) for x in c) and _linear(m, r)),
                     None)
        if found is not None:
            mlps.append((n, m, *found))
    if len(mlps) != 1:
        return None
    name, mlp, cols, row = mlps[0]
    if _others(mlp, (*cols, row)):
        return None
    prefix = f"{name}." if name else ""
    plan.update({f"{prefix}{c}": "col" for c in cols})
    plan[f"{prefix}{row}"] = "row"
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    if not heads:
        return None
    return plan, divisors_of_all(heads, kv, getattr(mlp, cols[0]).out_features)


class GenericBlock(_Layer):
    """One block of the model, called as the model calls it. Tensor parallel where :func:`_tensor_parallel`
    recognizes the block: query / key / value and the MLP's input projections column-parallel, the attention's
    output and the MLP's output projection row-parallel."""

    def __init__(self, block: nn.Module, plan: _Plan, index: int, config: Any = None,
                 router: tuple[RouterLoss, list[tuple[str, int]]] | None = None) -> None:
        super().__init__([block])
        self.plan, self.index = plan, index
        self.uses = _refs(plan.templates[index][0]) | _refs(plan.templates[index][1])
        self.tp = _tensor_parallel(block, config)
        #: the load-balancing term and this block's routers (name, output index): their per-sample statistics are
        #: added to the accumulator the prologue started (:mod:`.generic_router`)
        self.router = router

    def uniap_tp_degrees(self) -> list[int]:
        return self.tp[1] if self.tp is not None else [1]

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        assert self.tp is not None
        return {f"units.0.{path}": (colwise() if kind == "col" else rowwise()) for path, kind in self.tp[0].items()}

    def uniap_tp_allreduces(self) -> int:
        return 2 if self.tp is not None else 0

    def forward(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden = _contiguous_grad(d["hidden"])
        values = self.plan.decode(d, self.uses, hidden.shape[0])
        args, kwargs = self.plan.templates[self.index]
        seen, handles = caught_logits(self.units[0], self.router[1]) if self.router is not None else ([], [])
        try:
            out = self.units[0](*_fill(args, hidden, values),
                                **{k: _fill(v, hidden, values) for k, v in kwargs.items()})
        finally:
            for handle in handles:
                handle.remove()
        hidden = _first(out).contiguous()  # (ConvNeXt's stages return a permuted view; sent as it is)
        if self.router is None:
            return {"hidden": hidden}
        return {"hidden": hidden, ROUTER: d[ROUTER] + self.router[0].statistics(seen, d[TOKEN_MASK])}


class GenericEpilogue(_Layer):
    """The modules the model runs after its last block, in its order (final norm, LM head) -> logits. Tensor
    parallel over the vocabulary when the last is an ``nn.Linear`` (logits gathered)."""

    def __init__(self, sequence: list[nn.Module], unused: list[nn.Module],
                 pool: tuple[int, str] | None = None) -> None:
        super().__init__(sequence + unused)
        self.steps = len(sequence)
        self.pool = pool
        #: the load-balancing term: the output becomes ``(logits, each sample's share of it)``
        self.router: RouterLoss | None = None
        #: the ranks holding the micro-batch's other samples at this layer (set by the runtime; ``None``: all here)
        self.uniap_batch_group: Any = None

    def forward(self, d: dict[str, torch.Tensor]) -> Any:
        x = _contiguous_grad(d["hidden"])
        for i, m in enumerate(list(self.units)[: self.steps]):
            if self.pool is not None and self.pool[0] == i:
                if self.pool[1] == _LAST_TOKEN:  # (clamped: pipeline shape inference runs on arbitrary values)
                    last = d[_LAST].clamp(0, x.shape[1] - 1)
                    x = x[torch.arange(x.shape[0], device=x.device), last]
                else:
                    x = _POOLS[self.pool[1]](x)
            x = m(x)
        return x if self.router is None else (x, self.router.pooled(d[ROUTER], self.uniap_batch_group))

    def uniap_tp_degrees(self) -> list[int]:
        last = self.units[self.steps - 1]
        return divisors_of_all(last.out_features) if isinstance(last, nn.Linear) else [1]

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        return {f"units.{self.steps - 1}": colwise(output_layouts=replicate())}

    def uniap_tp_allreduces(self) -> int:
        return 1


_LAST, _LAST_TOKEN = "uniap_last", "last non-padding token"
#: how heads pool the hidden states in a top-level forward (between two of the modules run after the blocks); and
#: :data:`_LAST_TOKEN`, at the index the prologue sends
_POOLS = {
    "first token": lambda x: x[:, 0],
    "mean over the sequence": lambda x: x.mean(1),
    "mean over the tokens after the first": lambda x: x[:, 1:].mean(1),
    "mean over the feature map": lambda x: x.mean((-2, -1)),
}


def _epilogue(model: Any, task: _Task, prologue: nn.Module, blocks: list[nn.Module], after: list[nn.Module],
              unused: list[nn.Module], batch: dict[str, torch.Tensor], reference: Any) -> GenericEpilogue:
    """The modules run after the blocks, in order; where that does not give the model's logits on the probe batch,
    the first variant that does: a pooling (:data:`_POOLS`) before one of them, and / or one of them left out (a
    module whose output the head does not use, e.g. CLIP's pooled-output norm). Unmasked pooling only passes the
    check when the model pools that way on the padded probe too."""
    from uniap_lightning.runtime.payload import call_layer

    plain = GenericEpilogue(after, unused)
    theirs = task.logits(reference)
    if not isinstance(theirs, torch.Tensor) or len(after) > 4:
        return plain
    kinds = list(_POOLS)
    if task is _CLASSIFY and "input_ids" in batch:  # a decoder's classifier: at each row's last real token
        prologue.last = (getattr(model.config, "pad_token_id", None),)
        kinds.append(_LAST_TOKEN)
    hiddens = []
    for lo, hi in ((0, 1), (1, 3)):
        x: Any = {k: v[lo:hi] for k, v in batch.items()}
        for layer in (prologue, *blocks):
            x = call_layer(layer, x)
        hiddens.append(x)

    def matches(epilogue: GenericEpilogue) -> bool:
        try:
            ours = torch.cat([epilogue(h) for h in hiddens])
        except Exception:  # noqa: BLE001 - a variant whose shapes do not fit
            return False
        if ours.shape != theirs.shape:
            return False
        tol = 1e-4 if ours.dtype == torch.float32 else 3e-2
        return float((ours.float() - theirs.float()).abs().max() / theirs.abs().max().clamp(min=1)) <= tol

    if matches(plain):
        prologue.last = None
        return plain
    chosen = _first_match(plain, after, unused, kinds, matches)
    if chosen is not None:
        if chosen.pool is None or chosen.pool[1] != _LAST_TOKEN:
            prologue.last = None
        return chosen
    prologue.last = None
    shape = tuple(torch.cat([plain(h) for h in hiddens]).shape)
    if shape != tuple(theirs.shape):
        raise _refuse(model, f"its head pools the hidden states in its top-level forward in a way the split does not "
                             f"reproduce (its logits are {tuple(theirs.shape)}, the chain's {shape}; tried the first "
                             "token, the last real token and unmasked means), e.g. over what its attention mask "
                             "keeps")
    return plain


def _first_match(plain: GenericEpilogue, after: list[nn.Module], unused: list[nn.Module], kinds: list[str],
                 matches: Any) -> GenericEpilogue | None:
    """The first epilogue variant giving the model's logits: a module left out and / or a pooling before one."""
    for skip in (None, *range(len(after) - 1)):
        sequence = [m for i, m in enumerate(after) if i != skip]
        rest = unused + ([after[skip]] if skip is not None else [])
        if skip is not None and matches(GenericEpilogue(sequence, rest)):
            return GenericEpilogue(sequence, rest)
        for position in range(len(sequence)):
            for kind in kinds:
                candidate = GenericEpilogue(sequence, rest, (position, kind))
                if matches(candidate):
                    return candidate
    return None


# ------------------------------------------------------------------------------------------------------ building
#: the batch entry a model's forward takes first, by modality
_MAIN = ("input_ids", "pixel_values", "input_values", "input_features")
#: the main inputs the setup probe masks (``[batch, seq]`` or ``[batch, samples]``: a mask per position)
_MASKED = ("input_ids", "input_values")


def _main_input(model: Any) -> str:
    params = inspect.signature(model.forward).parameters
    main = next((k for k in _MAIN if k in params), None)
    if main is None:
        raise _refuse(model, f"its forward takes none of {list(_MAIN)}")
    return main


def _wave(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    return torch.sin(torch.arange(n, device=device, dtype=torch.float32) * 0.37).reshape(shape).to(dtype)


def _audio_length(config: Any, frames: int = 6) -> int:
    """Samples a raw-audio encoder turns into ``frames`` frames (its feature extractor's kernels and strides)."""
    length = frames
    for kernel, stride in reversed(list(zip(config.conv_kernel, config.conv_stride))):
        length = (length - 1) * stride + kernel
    return length


def _probe(model: Any, rows: int, device: torch.device, padded: bool = True) -> dict[str, torch.Tensor]:
    """A deterministic batch built from the config (no random numbers drawn): token ids (the last sample's last
    token is padding when ``padded``), images of the configured size and channels, raw audio of a few frames (the
    last sample's tail masked when ``padded`` and the model takes a mask) or the configured log-mel features."""
    main = _main_input(model)
    config = model.config
    dtype = next(model.parameters()).dtype
    takes_mask = "attention_mask" in inspect.signature(model.forward).parameters
    if main == "pixel_values":
        vision = getattr(config, "vision_config", None) or config
        size = vision.image_size
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        return {"pixel_values": _wave((rows, int(vision.num_channels), h, w), device, dtype)}
    if main == "input_values":
        length = _audio_length(config)
        batch = {"input_values": _wave((rows, length), device, dtype)}
        if takes_mask:
            mask = torch.ones(rows, length, dtype=torch.long, device=device)
            if padded:
                mask[-1, length * 2 // 3:] = 0
            batch["attention_mask"] = mask
        return batch
    if main == "input_features":
        frames = 2 * int(config.max_source_positions)
        return {"input_features": _wave((rows, int(config.num_mel_bins), frames), device, dtype)}
    vocab = int(getattr(config, "vocab_size", 0) or 2)
    seq = 4
    ids = (torch.arange(rows * seq, device=device).reshape(rows, seq) * 7 + 3) % max(vocab - 1, 1) + 1
    mask = torch.ones(rows, seq, dtype=torch.long, device=device)
    if padded:
        mask[-1, -1] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _accepted(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``kwargs`` the model's forward takes (the base model's flags, e.g. ``use_cache``, are not every head's)."""
    params = inspect.signature(model.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _base_inputs(base: nn.Module) -> tuple[tuple[str, ...], dict[str, Any]]:
    params = inspect.signature(base.forward).parameters
    main = next((k for k in _MAIN if k in params), None)
    if main is None:
        raise UniAPError(f"its base model takes none of {list(_MAIN)}")
    inputs = (main, *(k for k in ("attention_mask", "token_type_ids", "position_ids")
                      if k in params and (main != "input_features" or k != "attention_mask")))
    extra = {k: False for k in ("use_cache", "output_attentions", "output_hidden_states") if k in params}
    return inputs, extra


def generic_layers(model: Any) -> list[tuple[nn.Module, list[str]]]:
    """The chain's layers (with the FQNs each wraps); :class:`Unsplittable` naming why when the model cannot be split
    this way (whatever failed, here at setup rather than later in training)."""
    try:
        return _split(model)
    except Unsplittable:
        raise
    except Exception as e:  # noqa: BLE001 - the model's code on an unexpected path: reported with its reason
        raise _refuse(model, f"{type(e).__name__}: {e}") from e


def _split(model: Any) -> list[tuple[nn.Module, list[str]]]:
    drops = {k: v for k, v in vars(model.config).items() if k.endswith("layerdrop") and v}
    if drops:  # (wav2vec2's default 0.1, ...)
        raise _refuse(model, f"it skips blocks at random in training (LayerDrop: {drops})")
    base = model.base_model
    blocks_name, blocks = _find_blocks(model)
    base_prefix = next((n for n, m in model.named_modules() if m is base), None)
    if base_prefix is None or not (base_prefix == "" or blocks_name.startswith(base_prefix + ".")):
        raise _refuse(model, f"its blocks '{blocks_name}' are not inside its base model")
    units = _units(model, blocks_name)
    inputs, extra = _base_inputs(base)
    device = next(model.parameters()).device
    ancestors = {blocks_name.rsplit(".", i)[0] for i in range(1, blocks_name.count(".") + 1)}
    hooked = {n: m for n, m in model.named_modules()
              if n and n not in ancestors and n != blocks_name and not n.startswith(blocks_name + ".")
              and not isinstance(m, nn.modules.loss._Loss)}  # (DistilBERT's loss module: the loss is ours)
    task = _task(model)
    calls = _Calls(hooked, blocks)
    with _eval_mode(model):
        with torch.no_grad():
            try:
                small = _capture(base, blocks, {**_probe(model, 2, device), **extra})
                large = _capture(base, blocks, {**_probe(model, 3, device), **extra})
                unpadded = _capture(base, blocks, {**_probe(model, 2, device, padded=False), **extra})
                batch = _probe(model, 3, device)
                labels = task.labels(model, batch)
                calls.order.clear()
                calls.phase = "before"
                reference = model(**batch, **task.kwargs(labels), **_accepted(model, extra))
            finally:
                calls.close()
            templates, tensors2 = _templates(small[1])
            templates3, tensors3 = _templates(large[1])
            if templates != templates3:
                raise _refuse(model, "it passes its blocks other arguments for batches of 2 and 3 samples")
            if templates != _templates(unpadded[1])[0]:  # e.g. no mask at all without padding
                raise _refuse(model, "it passes its blocks other arguments for batches with and without padding")
            plan = _Plan(templates, [_mode(model, j, a, b) for j, (a, b) in enumerate(zip(tensors2, tensors3))])
            before, between, after = calls.names("before"), calls.names("between"), calls.names("after")
            between = [n for n in between if n in units]
            if between:
                raise _refuse(model, f"it runs {between[0]} between its blocks")
            before = [n for n in before if n in units]
            # a module owning parameters directly holds its children too (DeiT's embeddings and patch embedding)
            before = [n for n in before if not any(n.startswith(a + ".") for a in before)]
            if not after:
                raise _refuse(model, "it runs nothing after its blocks (no head)")
            # the outermost modules run after the blocks (a head module as a whole, with what its forward does)
            after = [n for n in after if not any(a != n and n.startswith(a + ".") for a in after)]
            covered = [n for n in units if any(n == a or n.startswith(a + ".") for a in after)]
            twice = set(before) & set(covered)
            if twice:
                raise _refuse(model, f"it runs {sorted(twice)[0]} before and after its blocks")
            unused = [n for n in units if n not in before and n not in covered
                      and not any(n.startswith(a + ".") for a in before)
                      and any(True for _ in units[n].parameters())]
            unused = [n for n in unused if not any(n.startswith(a + ".") for a in unused)]
            prologue = GenericPrologue([units[n] for n in before], base, blocks, plan, extra, inputs,
                                       _embeddings(model, "input"))
            router = router_loss_of(model)
            prologue.router = router
            layers = [GenericBlock(b, plan, i, model.config,
                                   None if router is None else (router, router_modules(model, b)))
                      for i, b in enumerate(blocks)]
            heads = dict(model.named_modules())
            epilogue = _epilogue(model, task, prologue, layers, [heads[n] for n in after], [units[n] for n in unused],
                                 batch, reference)
            epilogue.router = router
            _verify(model, task, prologue, layers, epilogue, batch, labels, reference)

    every = dict(model.named_modules())

    def owners_first(names: list[str]) -> list[str]:
        return sorted(names, key=lambda n: not any(True for _ in every[n].parameters()))

    return [
        (prologue, owners_first(before)),
        *[(layer, [f"{blocks_name}.{i}"]) for i, layer in enumerate(layers)],
        (epilogue, owners_first(after) + unused),
    ]


def _verify(model: Any, task: _Task, prologue: nn.Module, blocks: list[nn.Module], epilogue: GenericEpilogue,
            batch: dict[str, torch.Tensor], labels: torch.Tensor, reference: Any) -> None:
    """The chain on the probe batch (split into micro-batches of 1 and 2 samples up to the epilogue, which pools the
    whole batch's router statistics as the model does) gives the model's own logits and loss."""
    from uniap_lightning.runtime.payload import call_layer, concat

    hiddens = []
    for lo, hi in ((0, 1), (1, 3)):
        x: Any = {k: v[lo:hi] for k, v in batch.items()}
        for layer in (prologue, *blocks):
            x = call_layer(layer, x)
        hiddens.append(x)
    output = call_layer(epilogue, concat(hiddens))
    ours = output[0] if epilogue.router is not None else output
    theirs = task.logits(reference)
    if not isinstance(theirs, torch.Tensor) or theirs.shape != ours.shape:
        raise _refuse(model, f"its output logits are {None if theirs is None else tuple(theirs.shape)}, the chain "
                             f"gives {tuple(ours.shape)}")
    tol = 1e-4 if ours.dtype == torch.float32 else 3e-2
    scale = theirs.abs().max().clamp(min=1)
    diff = float((ours.float() - theirs.float()).abs().max() / scale)
    if diff > tol:
        raise _refuse(model, f"the chain's logits differ from the model's by {diff:.2g} (relative) on a probe batch "
                             "(its forward does something the split does not reproduce, e.g. a soft cap on the "
                             "logits or a block run more than once)")
    _check_loss(model, task, output, labels, reference, tol, epilogue.router)


def _check_loss(model: Any, task: _Task, output: Any, labels: torch.Tensor, reference: Any, tol: float,
                router: RouterLoss | None = None) -> None:
    """The model's own loss is the chain's: the head's loss of the logits (``output``), plus the load-balancing
    term where the model adds one (``router``; ``output`` is then ``(logits, per-sample term)``)."""
    count = task.count(labels).to(torch.float64).clamp(min=1)  # one count per column for question answering
    scale = (labels.shape[0] / count).to(torch.float32)
    target = HFTarget(labels, scale.expand(labels.shape[0], *scale.shape))
    head = float(task.loss(model, output[0] if router is not None else output, target))
    loss = head if router is None else float(router.wrap(task.loss)(model, output, target))
    own = None if reference.loss is None else float(reference.loss)
    if own is not None and abs(loss - own) <= tol * max(1.0, abs(loss)):
        return
    if own is None:
        raise _refuse(model, f"it computes no loss of its own (the {task.what} was {loss:.6g})")
    aux = getattr(reference, "aux_loss", None)  # (Hugging Face MoE outputs: the load-balancing loss, unscaled)
    if router is not None:
        raise _refuse(model, f"its loss adds a term the split cannot rebuild: its own loss ({own:.6g}) is not the "
                             f"{task.what} ({head:.6g}) + router_aux_loss_coef x the pooled top-k load-balancing "
                             f"loss (together {loss:.6g}); this family's auxiliary loss is computed otherwise (train "
                             "it with output_router_logits=False or define uniap_layers())")
    if isinstance(aux, torch.Tensor):
        raise _refuse(model, f"its loss adds a term the split cannot rebuild: its own loss ({own:.6g}) is the "
                             f"{task.what} ({head:.6g}) + {own - head:.6g}, and the model reports an auxiliary loss "
                             f"(aux_loss={float(aux):.6g}, e.g. its routers' load balancing) whose form the split "
                             "does not know for this model")
    raise _refuse(model, f"its own loss ({own:.6g}) is not the {task.what} ({head:.6g})")


def _task(model: Any) -> _Task:
    name = type(model).__name__
    if "return_loss" in inspect.signature(model.forward).parameters:
        raise _refuse(model, "its contrastive loss compares every sample with every other of the whole batch, which "
                             "does not decompose over micro-batches (train it with a loss of your own)")
    for suffix, task in _TASKS.items():
        if name.endswith(suffix):
            if task.loss is _ctc_loss and (
                    not hasattr(model, "_get_feat_extract_output_lengths")
                    or getattr(model.config, "ctc_loss_reduction", None) not in ("sum", "mean")):
                break
            if task.loss is _ctc_loss and model.config.ctc_loss_reduction == "sum":
                return _Task(task.what, task.loss, count_one, task.labels, task.target, task.given)
            return task
    raise _refuse(model, f"the generic split handles {_HEADS}")


def _embeddings(model: Any, which: str) -> nn.Module | None:
    """The model's input or output embedding; ``None`` for a model without one (an image or audio encoder)."""
    try:
        return getattr(model, f"get_{which}_embeddings")()
    except (NotImplementedError, AttributeError):
        return None


def _fqn(model: nn.Module, module: Any) -> str | None:
    return next((n for n, m in model.named_modules() if m is module), None) if module is not None else None


def generic_family(model: Any) -> Family:
    """The family of a causal LM, masked LM or sequence classifier with no builder in ``FAMILIES`` (the generic
    split, or the whole model as one layer); a clear error for anything else."""
    if getattr(model.config, "is_encoder_decoder", False) and (  # encoder-decoder LMs: their own split
            "decoder_input_ids" in inspect.signature(model.forward).parameters):  # (not Whisper's audio classifier)
        from uniap_lightning.adapters.families.seq2seq import seq2seq_family

        return seq2seq_family(model)
    task = _task(model)
    if _register_attention() and hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(ATTENTION)
        except Exception:  # noqa: BLE001 - a model without SDPA: its own (eager) attention, whose masks are tensors
            pass
    ties: tuple[tuple[str, str], ...] = ()
    src, dst = _embeddings(model, "input"), _embeddings(model, "output")
    if src is not None and dst is not None and getattr(src, "weight", None) is getattr(dst, "weight", 0):
        a, b = _fqn(model, src), _fqn(model, dst)
        if a and b:
            ties = ((a, b),)
    try:
        inputs, _ = _base_inputs(model.base_model)
    except UniAPError as e:
        raise _refuse(model, str(e)) from None
    if task.one_layer:
        return _one_layer(model, task, inputs, _refuse(model, task.one_layer))
    router = router_loss_of(model)
    try:
        pairs = generic_layers(model)  # (the weights still tied: the split refers to modules, not to weights)
    except Unsplittable as e:
        if router is not None:  # one layer gives the logits only, not the routers' statistics
            raise _refuse(model, f"{e.reason}; and its loss adds the routers' load-balancing term "
                                 "(output_router_logits=True), which the one-layer fallback cannot rebuild (it sees "
                                 "the logits only): train it with output_router_logits=False") from None
        return _one_layer(model, task, inputs, e)
    return Family(layers=lambda _: pairs, loss=task.loss if router is None else router.wrap(task.loss),
                  inputs=inputs, count=task.count, attention=None, ties=ties,
                  labels=None if task.target is None else task.target(model))


class WholeModel(_Layer):
    """The whole model as one layer (input ids and mask -> logits): trains replicated or sharded (ZeRO), with
    neither pipeline nor tensor parallelism."""

    def __init__(self, model: nn.Module, inputs: tuple[str, ...], output: Any = None) -> None:
        super().__init__([])
        self.model = model
        self.inputs = inputs
        self.output = output  # the model's output -> logits (default: .logits)

    def forward(self, d: dict[str, torch.Tensor]) -> torch.Tensor:
        kwargs = {k: d[k] for k in self.inputs if k in d}
        if "use_cache" in inspect.signature(self.model.forward).parameters:
            kwargs["use_cache"] = False
        out = self.model(**kwargs)
        return out.logits if self.output is None else self.output(out)


def _one_layer(model: Any, task: _Task, inputs: tuple[str, ...], why: UniAPError) -> Family:
    """The fallback for a model the generic split cannot reproduce: the model as one layer, after checking that its
    own loss is the task's loss of its logits (then the whole-batch normalization holds)."""
    layer = WholeModel(model, inputs, task.output)
    with _eval_mode(model), torch.no_grad():
        batch = _probe(model, 3, next(model.parameters()).device)
        batch = task.probe(batch) if task.probe is not None else batch
        labels = task.labels(model, batch)
        kwargs = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
        try:
            reference = model(**batch, **task.kwargs(labels), **kwargs)
            logits = layer(batch)
        except Exception as e:  # noqa: BLE001 - the model's own forward fails on the probe: why says why
            raise why from e
    owners = _accept_one_layer(model, task, logits, labels, reference, why)
    return Family(layers=lambda _: [(layer, owners)], loss=task.loss, inputs=inputs, count=task.count, attention=None,
                  labels=None if task.target is None else task.target(model))
