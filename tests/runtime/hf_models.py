"""The five paper models (BERT, T5, ViT, Swin, Llama) and GPT-2 at tiny sizes, as a user would train them: a
LightningModule holding the Hugging Face model, whose training step is the model's own loss on a dict batch. The
strategy splits them with no other code. Dropout is off (parity with one device needs it, see the README)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

VOCAB, SEQ, PAD, CHOICES = 64, 8, 0, 3

#: the other heads of the text families (issue 20): ``<family>_<head>`` -> the Hugging Face class
HEADS = {
    "bert_tc": "BertForTokenClassification", "bert_qa": "BertForQuestionAnswering", "bert_mc": "BertForMultipleChoice",
    "bert_reg": "BertForSequenceClassification",  # num_labels=1: regression (float labels)
    "gpt2_sc": "GPT2ForSequenceClassification", "gpt2_tc": "GPT2ForTokenClassification",
    "gpt2_qa": "GPT2ForQuestionAnswering",
    "llama_sc": "LlamaForSequenceClassification", "llama_tc": "LlamaForTokenClassification",
    "llama_qa": "LlamaForQuestionAnswering",
    "llama_multilabel": "LlamaForSequenceClassification",  # problem_type multi_label_classification
}


class HFModule(pl.LightningModule):
    def __init__(self, model: Any, lr: float = 0.1) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def build(family: str) -> Any:
    """A tiny randomly initialized model of ``family`` (seeded by the caller)."""
    import transformers as tr

    if family in HEADS:
        base = family.split("_")[0]
        config = build(base).config
        config.num_labels = {"bert_reg": 1, "bert_qa": 2}.get(family, 3)
        config.pad_token_id = PAD
        if family == "llama_multilabel":
            config.problem_type = "multi_label_classification"
        if base == "gpt2":
            config.classifier_dropout = 0.0
        if base == "llama":
            config.classifier_dropout = 0.0
        return getattr(tr, HEADS[family])(config)
    if family == "bert":
        return tr.BertForSequenceClassification(tr.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=SEQ, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            pad_token_id=PAD))
    if family == "bert_mlm":  # BERT's pretraining head: the decoder tied to the word embeddings (the default)
        return tr.BertForMaskedLM(tr.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD))
    if family in ("gpt2", "gpt2_tied"):  # GPT-2's default ties the LM head to the token embedding
        return tr.GPT2LMHeadModel(tr.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, tie_word_embeddings=family == "gpt2_tied", bos_token_id=0, eos_token_id=0))
    if family == "llama":
        return tr.LlamaForCausalLM(tr.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False, pad_token_id=PAD))
    if family == "t5":
        return tr.T5ForConditionalGeneration(tr.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            relative_attention_num_buckets=8, dropout_rate=0.0, tie_word_embeddings=False, pad_token_id=PAD,
            decoder_start_token_id=PAD, feed_forward_proj="relu"))
    if family == "vit":
        return tr.ViTForImageClassification(tr.ViTConfig(
            image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if family == "swin":
        return tr.SwinForImageClassification(tr.SwinConfig(
            image_size=8, patch_size=2, num_channels=3, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=2,
            mlp_ratio=2.0, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            drop_path_rate=0.0))
    raise ValueError(family)


def hf_module(family: str, lr: float = 0.1) -> HFModule:
    torch.manual_seed(0)
    return HFModule(build(family), lr=lr)


def hf_batches(batch_size: int, family: str, n: int = 32, seed: int = 1, left: bool = False) -> Any:
    """Dict batches as Hugging Face users have them; text with right padding (``left``: left padding, as decoders
    are batched for generation) of varying length (labels -100 where padded), so micro-batches hold different
    numbers of real tokens."""
    from torch.utils.data import DataLoader

    g = torch.Generator().manual_seed(seed)
    rows: list[dict[str, torch.Tensor]] = []
    for _ in range(n):
        if family in ("vit", "swin"):
            rows.append({"pixel_values": torch.randn(3, 8, 8, generator=g),
                         "labels": torch.randint(0, 3, (), generator=g)})
            continue
        if family in ("bert_mc",):  # [choices, seq] per row, one label per row
            lengths = torch.randint(2, SEQ + 1, (CHOICES, 1), generator=g)
            mask = (torch.arange(SEQ) < lengths).long()
            ids = torch.randint(1, VOCAB, (CHOICES, SEQ), generator=g) * mask
            rows.append({"input_ids": ids, "attention_mask": mask, "token_type_ids": (torch.arange(SEQ) >= 3).long()
                         .expand(CHOICES, SEQ) * mask, "labels": torch.randint(0, CHOICES, (), generator=g)})
            continue
        length = int(torch.randint(2, SEQ + 1, (), generator=g))
        ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
        mask = (torch.arange(SEQ) >= SEQ - length if left else torch.arange(SEQ) < length).long()
        ids = ids * mask  # PAD = 0 after the end (before the start with left padding)
        if family.endswith("_tc"):  # a label per real token, some real tokens unlabelled too
            labels = torch.randint(0, 3, (SEQ,), generator=g)
            unlabelled = (mask == 0) | (torch.rand(SEQ, generator=g) < 0.2)
            rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels.masked_fill(unlabelled, -100)})
        elif family.endswith("_qa"):  # positions past the input (ignored) and negative ones (clamped to 0) too
            start, end = torch.randint(-1, SEQ + 2, (2,), generator=g)
            rows.append({"input_ids": ids, "attention_mask": mask, "start_positions": start, "end_positions": end})
        elif family == "bert_reg":
            rows.append({"input_ids": ids, "attention_mask": mask, "labels": torch.randn((), generator=g)})
        elif family == "llama_multilabel":
            rows.append({"input_ids": ids, "attention_mask": mask,
                         "labels": (torch.rand(3, generator=g) < 0.5).float()})
        elif family in ("bert", "gpt2_sc", "llama_sc"):
            rows.append({"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (), generator=g)})
        elif family == "bert_mlm":  # about a third of the real tokens are predicted (the rest -100)
            chosen = (torch.rand(SEQ, generator=g) < 0.35) & (mask == 1)
            chosen[0] = True
            rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(~chosen, -100)})
        elif family == "t5":
            tl = int(torch.randint(1, SEQ + 1, (), generator=g))
            target = torch.randint(1, VOCAB, (SEQ,), generator=g)
            labels = torch.where(torch.arange(SEQ) < tl, target, torch.full_like(target, -100))
            rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
        else:  # causal LMs (gpt2, gpt2_tied, llama)
            rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return DataLoader(rows, batch_size=batch_size, shuffle=False, drop_last=True)
