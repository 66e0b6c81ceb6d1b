"""The heads of the generic split (:mod:`.generic`): per Hugging Face head (the model class's suffix), the loss the
chain computes (the model's own, whole-batch normalized), what it counts, the probe's labels, and how a batch's
labels become the chain's target; :func:`_task` picks one per model."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from uniap_lightning.adapters.family import HFTarget, count_next_tokens, count_rows, count_tokens
from uniap_lightning.adapters.families.common import (
    causal_lm_loss,
    count_labels,
    count_per_column,
    question_answering_labels,
    question_answering_loss,
    sequence_classification_loss,
    token_loss,
)
from uniap_lightning.adapters.families.generic_trace import _refuse


def _masked_lm_loss(model: Any, logits: torch.Tensor, target: HFTarget) -> torch.Tensor:
    return token_loss(logits, target.labels, target)


def _rows(batch: dict[str, torch.Tensor]) -> tuple[int, torch.device]:
    first = next(iter(batch.values()))
    return first.shape[0], first.device


def _token_labels(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)


def _tag_labels(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Token classification: a class per real token (padding -100)."""
    return (batch["input_ids"] % int(model.config.num_labels)).masked_fill(batch["attention_mask"] == 0, -100)


def _class_labels(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sequence / image / audio classification, as the config's problem type (or number of labels) has it: class
    ids, regression values or multi-label 0 / 1 targets."""
    rows, device = _rows(batch)
    config = model.config
    n = int(config.num_labels)
    kind = getattr(config, "problem_type", None)
    if kind == "regression" or (kind is None and n == 1):
        values = torch.arange(rows * n, device=device, dtype=torch.float32).reshape(rows, n) * 0.5 - 0.3
        return values.reshape(rows) if n == 1 else values
    if kind == "multi_label_classification":
        return ((torch.arange(rows * n, device=device).reshape(rows, n) % 3) == 0).float()
    return torch.arange(rows, device=device) % n


def _span_labels(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Question answering: ``[batch, 2]`` start and end positions inside the sequence."""
    rows, device = _rows(batch)
    seq = batch["input_ids"].shape[-1]
    start = torch.arange(rows, device=device) % seq
    return torch.stack([start, (start + 2) % seq], -1)


def _span_kwargs(labels: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"start_positions": labels[:, 0], "end_positions": labels[:, 1]}


def _span_logits(output: Any) -> torch.Tensor:
    return torch.stack([output.start_logits, output.end_logits], -1)


_CHOICES = 2


def _choices(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Multiple choice: the probe as ``[batch, choices, seq]``, the choices differing."""
    out = {}
    for k, v in batch.items():
        v = torch.stack([v, v.roll(1, -1)], 1) if k == "input_ids" else v.unsqueeze(1).expand(-1, _CHOICES, -1)
        out[k] = v.contiguous()
    return out


def _choice_labels(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    rows, device = _rows(batch)
    return torch.arange(rows, device=device) % _CHOICES


def _ctc_frames(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each row's number of output frames, as the model computes it for its CTC loss."""
    values = batch["input_values"]
    mask = batch.get("attention_mask")
    lengths = mask.sum(-1) if mask is not None else torch.full(values.shape[:1], values.shape[-1],
                                                                 device=values.device)
    return model._get_feat_extract_output_lengths(lengths).to(torch.long)


def _ctc_labels(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """CTC: the target is the row's frame count followed by its labels (-100 after the end), so the loss has the
    input lengths the model's own loss uses."""
    rows, device = _rows(batch)
    vocab = int(model.config.vocab_size)
    labels = (torch.arange(rows * 3, device=device).reshape(rows, 3) * 5 + 1) % (vocab - 1) + 1
    labels[-1, -1] = -100
    return torch.cat([_ctc_frames(model, batch)[:, None], labels], 1)


def _ctc_kwargs(labels: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"labels": labels[:, 1:]}


def _ctc_loss(model: Any, logits: torch.Tensor, target: HFTarget) -> torch.Tensor:
    """Hugging Face's CTC loss (blank = the pad token, zero_infinity as configured) per row, summed and whole-batch
    normalized: ``ctc_loss_reduction="sum"`` sums over the batch (count 1), ``"mean"`` averages each row's loss over
    its target length, then over the rows. Both decompose over micro-batches."""
    frames, labels = target.labels[:, 0], target.labels[:, 1:]
    config = model.config
    given = labels >= 0
    log_probs = nn.functional.log_softmax(logits, dim=-1, dtype=torch.float32).transpose(0, 1)
    with torch.backends.cudnn.flags(enabled=False):
        per_row = nn.functional.ctc_loss(log_probs, labels.masked_select(given), frames, given.sum(-1),
                                         blank=config.pad_token_id, reduction="none",
                                         zero_infinity=config.ctc_zero_infinity)
    if config.ctc_loss_reduction == "mean":
        per_row = per_row / given.sum(-1).clamp(min=1)
    return per_row.sum() * target.per_item_sum_scale()


def count_one(labels: torch.Tensor) -> torch.Tensor:
    """A loss summed over the batch (not averaged): the whole batch counts once."""
    return torch.tensor(1)


@dataclass(frozen=True)
class _Task:
    """What a head of the generic split trains on: its loss, what it counts, probe labels ``(model, probe batch) ->
    labels``; ``target`` (``model -> (batch -> labels)``, default ``batch["labels"]``), ``given`` (labels -> the
    model's keyword arguments, default ``labels=``), ``output`` (the model's output -> logits, default
    ``.logits``), ``probe`` (reshapes the probe batch), ``one_layer`` (why this head always trains as one layer)."""

    what: str
    loss: Any
    count: Any
    labels: Any
    target: Any = None
    given: Any = None
    output: Any = None
    probe: Any = None
    one_layer: str = ""

    def kwargs(self, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"labels": labels} if self.given is None else self.given(labels)

    def logits(self, output: Any) -> Any:
        return getattr(output, "logits", None) if self.output is None else self.output(output)


_CLASSIFY = _Task("sequence classification loss", sequence_classification_loss, count_labels, _class_labels)
_TASKS = {
    "ForCausalLM": _Task("causal LM cross-entropy", causal_lm_loss, count_next_tokens, _token_labels),
    "ForMaskedLM": _Task("masked LM cross-entropy", _masked_lm_loss, count_tokens, _token_labels),
    "ForSequenceClassification": _CLASSIFY,
    "ForImageClassification": _CLASSIFY,
    "ForAudioClassification": _CLASSIFY,
    "ForTokenClassification": _Task("token classification cross-entropy", _masked_lm_loss, count_tokens,
                                    _tag_labels),
    "ForQuestionAnswering": _Task("question answering loss", question_answering_loss, count_per_column,
                                  _span_labels, target=lambda model: question_answering_labels, given=_span_kwargs,
                                  output=_span_logits),
    "ForMultipleChoice": _Task("multiple choice cross-entropy", _masked_lm_loss, count_tokens, _choice_labels,
                               probe=_choices, one_layer="it flattens the choices in its top-level forward"),
    "ForCTC": _Task("CTC loss", _ctc_loss, count_rows, _ctc_labels,
                    target=lambda model: (lambda batch: None if batch.get("labels") is None else torch.cat(
                        [_ctc_frames(model, batch)[:, None], batch["labels"]], 1)),
                    given=_ctc_kwargs),
}
_HEADS = ("causal LMs (*ForCausalLM), masked LMs (*ForMaskedLM), sequence / image / audio classifiers, token "
          "classifiers, question answering (*ForQuestionAnswering), multiple choice and CTC (*ForCTC)")


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
