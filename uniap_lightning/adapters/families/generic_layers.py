"""The layers of the generic split (:mod:`.generic`): the prologue (the base model's forward up to its first block,
sending the hidden states and what the blocks take), one layer per block (called as the model calls it), the
epilogue (the modules run after the last block, with the pooling a head does in its top-level forward) and the
whole model as one layer (the fallback). Each is a view over modules of the user's model; their tensor-parallel plans
are here (a block's is inferred by :mod:`.generic_tp`).
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from uniap_lightning.adapters.families.common import colwise, divisors_of_all, replicate, rowwise
from uniap_lightning.adapters.families.generic_probe import _MASKED
from uniap_lightning.adapters.families.generic_router import ROUTER, TOKEN_MASK, RouterLoss, caught_logits
from uniap_lightning.adapters.families.generic_tp import _tensor_parallel
from uniap_lightning.adapters.families.generic_trace import _capture, _fill, _Plan, _refs, _templates
from uniap_lightning.adapters.families.text_heads import _last_non_padding
from uniap_lightning.errors import UniAPError


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


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
