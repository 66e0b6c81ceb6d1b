"""A Hugging Face BERT sequence classifier on lines of the shipped corpus, padded to the longest line of the
batch, trained with Trainer(strategy="uniap") and no adapter code: the LightningModule holds the model and returns
its own loss; the strategy recognizes BERT and splits it (embedding, blocks, pooler + classifier) itself.

Task: tell whether a line starts with a capital letter, a lower-case letter or anything else (three classes,
chance loss ln 3). Built from a config (random weights, nothing downloaded).

    pip install -e ".[hf]" && python examples/hf_bert_classify.py --devices 2 --steps 30
"""

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification

from uniap_lightning.data import VOCAB_SIZE, corpus_text, encode

PAD, CLS, MAX_LEN = 0, 1, 48

parser = argparse.ArgumentParser()
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--steps", type=int, default=30)
args = parser.parse_args()


def label(line: str) -> int:
    return 0 if line[0].isupper() else 1 if line[0].islower() else 2


def collate(lines: list[str]) -> dict[str, torch.Tensor]:
    """Pad to the batch's longest line: ``attention_mask`` marks the real characters."""
    ids = [torch.cat([torch.tensor([CLS]), encode(line[: MAX_LEN - 1])]) for line in lines]
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), PAD)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, : len(x)], mask[i, : len(x)] = x, 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": torch.tensor([label(s) for s in lines])}


class Classifier(L.LightningModule):
    def __init__(self, model: BertForSequenceClassification) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


L.seed_everything(0)
lines = [s.strip() for s in corpus_text().splitlines() if len(s.strip()) > 3]
config = BertConfig(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                    intermediate_size=128, max_position_embeddings=MAX_LEN, num_labels=3, pad_token_id=PAD,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
model = Classifier(BertForSequenceClassification(config))
loader = DataLoader(lines, batch_size=16, shuffle=True, drop_last=True, collate_fn=collate,
                    generator=torch.Generator().manual_seed(0))
trainer = L.Trainer(strategy="uniap", accelerator="cpu", devices=args.devices, max_steps=args.steps,
                    enable_checkpointing=False, logger=False, log_every_n_steps=5)
trainer.fit(model, loader)
if trainer.is_global_zero:
    print(f"final train loss: {float(trainer.callback_metrics['train_loss']):.4f}")
