"""A tiny mixture-of-experts GPT written as a chain: the GPT of :mod:`.gpt` with each block's MLP replaced by experts.

``MoEGPT(MoEGPTConfig(...)).layers()`` gives ``[Embedding, MoEBlock x n_layer, MoEHead]``; wrap it with
:class:`MoECausalLMModule`. The attention is :class:`.gpt.Block`'s own (``MoEBlock`` subclasses it).

The mixture of experts (:class:`MoEMLP`), per token of the flattened ``[B*T, h]`` input:

* router: ``probs = softmax(x @ W_r)`` over ``E`` experts; top-``k`` experts (``k = 2`` by default) with gates
  = their probabilities (renormalized to sum to one over the k when ``renormalize_gates``);
* capacity (GShard/Switch): each expert takes at most ``C = ceil(capacity_factor * N * k / E)`` of the ``N * k``
  assignments; assignments are ranked slot-major (every token's first choice before any token's second choice),
  then by token order, and those ranked ``>= C`` are *dropped* (that slot adds nothing: the token keeps only the
  residual and its other slot). ``capacity_factor=None`` never drops; ``capacity_factor >= E / k`` cannot drop;
* experts: stacked weights ``w_in [E, h, 4h]``, ``b_in [E, 4h]``, ``w_out [E, 4h, h]``, ``b_out [E, h]``;
  ``y = gelu(x @ w_in[e] + b_in[e]) @ w_out[e] + b_out[e]``; the output is ``sum over kept slots of gate * y``;
* auxiliary load-balancing loss (Switch, Fedus et al. eq. 4, over the k slots as Hugging Face Mixtral does):
  ``aux = coef * E * sum_e f_e * P_e`` with ``f_e`` the fraction of the ``N * k`` assignments routed to ``e``
  (counted before dropping) and ``P_e`` the mean router probability of ``e``. Balanced routing gives ``coef``.

How the auxiliary loss reaches the training loss through a chain (a pipeline stage can only carry tensors with the
batch on dim 0, see :mod:`uniap_lightning.runtime.payload`): each ``MoEBlock`` returns the tuple
``(hidden, aux)`` where ``aux`` is a ``[B, T]`` tensor, the running sum of the blocks' auxiliary losses broadcast
over the tokens (a block taking a plain tensor starts it). ``MoEHead`` returns ``(logits, aux)`` and
:meth:`MoECausalLMModule.uniap_loss` adds ``aux.mean()`` to the cross-entropy. Micro-batches split and join
``aux`` like any other tensor; each micro-batch's loss carries the auxiliary loss of its own routing.

Routing, capacity and the auxiliary loss are computed per call, i.e. per micro-batch under pipelining (as every
pipelined MoE does); there is no padding mask (every position is a token).

Expert parallelism: ``MoEMLP.experts_comm`` (``None``: all experts here) is the object that runs the experts and
reports routing counts across ranks; :func:`uniap_lightning.runtime.experts.apply_expert_parallel` installs one
that shards the experts and moves tokens with all-to-alls. The routing math stays here, in one place.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from uniap_lightning.adapters.chain_layers import NormHead
from uniap_lightning.adapters.gpt import Block, Embedding, GPTConfig
from uniap_lightning.adapters.lm import CausalLMModule
from uniap_lightning.errors import UniAPError

ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MoEGPTConfig(GPTConfig):
    n_experts: int = 4
    top_k: int = 2
    #: ``None``: no capacity limit (nothing is dropped)
    capacity_factor: float | None = 1.25
    aux_loss_coef: float = 0.01
    renormalize_gates: bool = False


class ExpertsComm(Protocol):
    """What :class:`MoEMLP` needs from an expert-parallel runtime (see ``runtime/experts.py``)."""

    #: this rank's index among the ranks whose tokens form one batch (capacity and auxiliary statistics)
    token_rank: int

    def gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``[k, E]`` assignments per slot and expert of this rank -> ``[R, k, E]`` of every token rank."""
        ...

    def run_experts(self, rows: torch.Tensor, rows_per_expert: torch.Tensor, expert_fn: ExpertFn) -> torch.Tensor:
        """``rows`` sorted by global expert (``rows_per_expert [E]``) -> each row through its expert, same order;
        ``expert_fn(local_index, x)`` runs one expert held here."""
        ...


def check_top_k(n_experts: int, top_k: int) -> None:
    if not 1 <= top_k <= n_experts:
        raise UniAPError(f"MoE top_k={top_k} must be between 1 and n_experts={n_experts}")


def capacity(capacity_factor: float | None, tokens: int, top_k: int, n_experts: int) -> int:
    """Assignments one expert takes: ``ceil(capacity_factor * tokens * top_k / n_experts)``."""
    if capacity_factor is None:
        return tokens * top_k
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


def keep_mask(expert: torch.Tensor, all_counts: torch.Tensor, token_rank: int, cap: int) -> torch.Tensor:
    """Which of this rank's ``[N, k]`` assignments fit their expert's capacity ``cap``.

    The global order is slot-major, then token rank, then token: assignment ``(n, j)`` to expert ``e`` is ranked
    after every slot ``< j`` assignment to ``e`` on every rank, every slot-``j`` one of lower token ranks, and this
    rank's earlier slot-``j`` ones. ``all_counts [R, k, E]`` holds every token rank's per-slot counts, so each rank
    decides exactly what one process on the concatenated batch decides.
    """
    n_experts = all_counts.shape[-1]
    onehot = F.one_hot(expert, n_experts)  # [N, k, E]
    total = all_counts.sum(0)  # [k, E]
    before_slot = total.cumsum(0) - total
    before_rank = all_counts[:token_rank].sum(0)
    within = onehot.cumsum(0) - onehot  # earlier tokens of this rank, same slot
    position = (within + before_slot + before_rank).gather(2, expert.unsqueeze(-1)).squeeze(-1)
    return position < cap


class MoEMLP(nn.Module):
    """Router + top-k + capacity + stacked experts; ``[..., h] -> ([..., h], auxiliary loss scalar)``."""

    #: the parameters stacked over experts on dim 0 (sharded by expert parallelism)
    uniap_expert_params = ("w_in", "b_in", "w_out", "b_out")

    def __init__(self, hidden: int, ffn: int, n_experts: int, *, top_k: int = 2,
                 capacity_factor: float | None = 1.25, aux_loss_coef: float = 0.01,
                 renormalize_gates: bool = False) -> None:
        super().__init__()
        check_top_k(n_experts, top_k)
        self.n_experts, self.top_k = n_experts, top_k
        self.capacity_factor, self.aux_loss_coef = capacity_factor, aux_loss_coef
        self.renormalize_gates = renormalize_gates
        self.router = nn.Linear(hidden, n_experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(n_experts, hidden, ffn).uniform_(-hidden ** -0.5, hidden ** -0.5))
        self.b_in = nn.Parameter(torch.empty(n_experts, ffn).uniform_(-hidden ** -0.5, hidden ** -0.5))
        self.w_out = nn.Parameter(torch.empty(n_experts, ffn, hidden).uniform_(-ffn ** -0.5, ffn ** -0.5))
        self.b_out = nn.Parameter(torch.empty(n_experts, hidden).uniform_(-ffn ** -0.5, ffn ** -0.5))
        #: set by the expert-parallel runtime; ``None`` runs every expert here
        self.experts_comm: ExpertsComm | None = None
        #: assignments dropped by capacity in the last forward (a 0-dim tensor; for tests and monitoring)
        self.last_dropped: torch.Tensor | None = None

    @property
    def dropless(self) -> bool:
        """No assignment can be dropped: no capacity, or one of at least every token (``cf >= E / k``)."""
        return self.capacity_factor is None or self.capacity_factor * self.top_k >= self.n_experts

    def _experts(self) -> ExpertFn:
        """``expert_fn(e, x)`` of this call: each stacked weight cut into its experts once, so the backward stacks
        their gradients into one full-size tensor (indexing ``w[e]`` per expert built E full-size zero-padded
        gradients and their sums: about twice the experts' bytes at the backward's peak, measured)."""
        w_in, b_in, w_out, b_out = (getattr(self, p).unbind(0) for p in self.uniap_expert_params)

        def expert(e: int, x: torch.Tensor) -> torch.Tensor:
            return F.gelu(x @ w_in[e] + b_in[e]) @ w_out[e] + b_out[e]

        return expert

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, k, n_experts = x.shape, self.top_k, self.n_experts
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(tokens), dim=-1)
        gate, expert = probs.topk(k, dim=-1)  # [N, k]
        if self.renormalize_gates:
            gate = gate / gate.sum(-1, keepdim=True)
        counts = F.one_hot(expert, n_experts).sum(0)  # [k, E]
        comm = self.experts_comm
        all_counts = counts.unsqueeze(0) if comm is None else comm.gather_counts(counts)
        total_tokens = int(all_counts[:, 0].sum())  # every token has exactly one first choice
        cap = capacity(self.capacity_factor, total_tokens, k, n_experts)
        keep = keep_mask(expert, all_counts, 0 if comm is None else comm.token_rank, cap)
        self.last_dropped = (~keep).sum().detach()
        # Switch's f_e over every token rank (no gradient), P_e over this rank's tokens: the mean over token ranks
        # of this loss is the loss of one process on the concatenated batch (equal tokens per rank)
        f = all_counts.sum((0, 1)).to(probs.dtype) / (total_tokens * k)
        aux = self.aux_loss_coef * n_experts * (f * probs.mean(0)).sum()

        token_of = torch.arange(tokens.shape[0], device=x.device).repeat_interleave(k)[keep.reshape(-1)]
        expert_of, gate_of = expert.reshape(-1)[keep.reshape(-1)], gate.reshape(-1)[keep.reshape(-1)]
        order = torch.argsort(expert_of, stable=True)
        token_of, gate_of = token_of[order], gate_of[order]
        rows_per_expert = torch.bincount(expert_of, minlength=n_experts)
        rows = tokens[token_of]
        expert_fn = self._experts()
        if comm is None:
            out_rows = torch.cat([expert_fn(e, r) for e, r in enumerate(rows.split(rows_per_expert.tolist()))])
        else:
            out_rows = comm.run_experts(rows, rows_per_expert, expert_fn)
        out = torch.zeros_like(tokens).index_add(0, token_of, out_rows * gate_of.unsqueeze(-1))
        return out.view(shape), aux


class MoEBlock(Block):
    """:class:`.gpt.Block`'s attention, then a mixture of experts in place of the dense MLP.

    ``x`` or ``(x, aux)`` -> ``(x, aux)``; ``aux [B, T]`` accumulates the auxiliary losses (see the module docstring).

    Context parallelism (:class:`.gpt.Block`'s Ulysses or ring attention) only where the experts drop nothing
    (``capacity_factor`` ``None`` or ``>= E / k``): a split sequence hands the router its tokens in another order
    than one process, which decides who is dropped. Otherwise the block declares no sequence behaviour, so profiles carry no sequence fields
    for it and the planner never splits its sequence. Tensor and sequence parallelism next to experts: not wired.
    """

    def __init__(self, cfg: MoEGPTConfig) -> None:
        super().__init__(cfg)
        del self.fc, self.fc_proj  # the dense MLP of Block, replaced by the experts
        c = cfg.n_embd
        self.moe = MoEMLP(c, 4 * c, cfg.n_experts, top_k=cfg.top_k, capacity_factor=cfg.capacity_factor,
                          aux_loss_coef=cfg.aux_loss_coef, renormalize_gates=cfg.renormalize_gates)

    def forward(self, x: torch.Tensor, aux: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self._attention(self.ln_1(x))
        y, layer_aux = self.moe(self.ln_2(x))
        # per token ([B, T]): under context parallelism each rank's piece carries its own term (the router's mean
        # probabilities over its tokens) and the mean over the whole sequences, gathered for the loss, is one process's
        layer_aux = layer_aux.expand(x.shape[:2])
        return x + y, layer_aux if aux is None else aux + layer_aux

    def uniap_sequence(self) -> dict[str, Any] | None:
        """Block's attention heads, no sequence parallelism; nothing where the experts may drop tokens."""
        return {**super().uniap_sequence(), "sequence_parallel": False} if self.moe.dropless else None

    def uniap_tp_degrees(self) -> list[int]:
        return [1]

    def uniap_sp_plan(self, tp: int) -> dict[str, Any]:
        raise UniAPError("MoEBlock: sequence parallelism is not supported next to experts yet (use tp=1)")

    def uniap_cp_methods(self) -> list[str]:
        return super().uniap_cp_methods() if self.moe.dropless else []

    def uniap_cp_degrees(self, tp: int = 1) -> list[int]:
        return super().uniap_cp_degrees(tp) if self.moe.dropless else [1]


class MoEHead(NormHead):
    """Final norm + LM head; ``(x, aux)`` -> ``(logits, aux)``."""

    def forward(self, hidden: torch.Tensor, aux: torch.Tensor | None = None) -> Any:
        logits = super().forward(hidden)
        return logits if aux is None else (logits, aux)


class MoEGPT(nn.Module):
    """Token ids ``[B, T]`` -> ``(logits [B, T, vocab], aux [B, T])``."""

    def __init__(self, cfg: MoEGPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.n_layer))
        self.head = MoEHead(nn.LayerNorm(cfg.n_embd), nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False))

    def layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def forward(self, ids: torch.Tensor) -> Any:
        x: Any = self.embed(ids)
        for block in self.blocks:
            x = block(*x) if isinstance(x, tuple) else block(x)
        return self.head(*x) if isinstance(x, tuple) else self.head(x)


class MoECausalLMModule(CausalLMModule):
    """:class:`.lm.CausalLMModule` whose chain ends in ``(logits, aux)``: the loss is cross-entropy + ``aux.mean()``."""

    def forward(self, input_ids: torch.Tensor) -> Any:
        x: Any = input_ids
        for layer in self.chain:  # a tuple is the next layer's arguments (as the strategy's chain runner does)
            x = layer(*x) if isinstance(x, tuple) else layer(x)
        return x

    def uniap_loss(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(output, tuple):
            logits, aux = output
            return super().uniap_loss(logits, labels) + aux.mean()
        return super().uniap_loss(output, labels)
