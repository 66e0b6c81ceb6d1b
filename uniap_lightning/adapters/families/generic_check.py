"""The generic split's checks at setup (:mod:`.generic`): the chain on a probe batch against the model's own forward
(logits and loss, the batch in two micro-batches), the search for the epilogue that gives the model's logits (a
pooling a head does in its top-level forward, a module whose output the head does not use), and the one-layer
fallback's check and warning.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from uniap_lightning.adapters.family import HFTarget
from uniap_lightning.adapters.families.generic_heads import _CLASSIFY, _Task
from uniap_lightning.adapters.families.generic_layers import _LAST_TOKEN, _POOLS, GenericEpilogue
from uniap_lightning.adapters.families.generic_router import RouterLoss
from uniap_lightning.adapters.families.generic_trace import _refuse
from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime.payload import call_layer, concat


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


def _epilogue(model: Any, task: _Task, prologue: nn.Module, blocks: list[nn.Module], after: list[nn.Module],
              unused: list[nn.Module], batch: dict[str, torch.Tensor], reference: Any) -> GenericEpilogue:
    """The modules run after the blocks, in order; where that does not give the model's logits on the probe batch,
    the first variant that does: a pooling (:data:`_POOLS`) before one of them, and / or one of them left out (a
    module whose output the head does not use, e.g. CLIP's pooled-output norm). Unmasked pooling only passes the
    check when the model pools that way on the padded probe too."""
    plain = GenericEpilogue(after, unused)
    theirs = task.logits(reference)
    if not isinstance(theirs, torch.Tensor) or len(after) > 4:
        return plain
    kinds = list(_POOLS)
    if task is _CLASSIFY and "input_ids" in batch:  # a decoder's classifier: at each row's last real token
        prologue.last = (getattr(model.config, "pad_token_id", None),)
        kinds.append(_LAST_TOKEN)
    hiddens = _hiddens(prologue, blocks, batch)

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


def _hiddens(prologue: nn.Module, blocks: list[nn.Module], batch: dict[str, torch.Tensor]) -> list[Any]:
    """The probe batch through the prologue and the blocks as two micro-batches, of 1 and 2 samples."""
    hiddens = []
    for lo, hi in ((0, 1), (1, 3)):
        x: Any = {k: v[lo:hi] for k, v in batch.items()}
        for layer in (prologue, *blocks):
            x = call_layer(layer, x)
        hiddens.append(x)
    return hiddens


def _verify(model: Any, task: _Task, prologue: nn.Module, blocks: list[nn.Module], epilogue: GenericEpilogue,
            batch: dict[str, torch.Tensor], labels: torch.Tensor, reference: Any) -> None:
    """The chain on the probe batch (split into micro-batches of 1 and 2 samples up to the epilogue, which pools the
    whole batch's router statistics as the model does) gives the model's own logits and loss."""
    hiddens = _hiddens(prologue, blocks, batch)
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
