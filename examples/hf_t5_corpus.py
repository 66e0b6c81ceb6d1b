"""A Hugging Face T5 (encoder-decoder) on the shipped corpus, trained with Trainer(strategy="uniap") and no
adapter code: the LightningModule holds the model and returns its own loss; the strategy recognizes T5 and splits
both stacks into one chain (the encoder's output travels with the decoder's hidden states through the pipeline).

Task: the encoder reads a fragment of a line, the decoder writes the characters that follow it; fragments and
continuations have varying lengths (padding, labels -100 where padded). Built from a config (random weights,
nothing downloaded).

    pip install -e ".[hf]" && python examples/hf_t5_corpus.py --devices 2 --steps 30
"""

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import T5Config, T5ForConditionalGeneration

from uniap_lightning.data import VOCAB_SIZE, corpus_text, encode

PAD, SRC, TGT = 0, 24, 16

parser = argparse.ArgumentParser()
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--steps", type=int, default=30)
args = parser.parse_args()


def pairs(text: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(fragment, continuation) of every line long enough, the split point varying with the line."""
    out = []
    for line in (s.strip() for s in text.splitlines()):
        if len(line) < 12:
            continue
        cut = 4 + len(line) % (min(SRC, len(line) - 4) - 3)
        out.append((encode(line[:cut][-SRC:]), encode(line[cut : cut + TGT])))
    return out


def collate(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    src = torch.full((len(batch), SRC), PAD)
    mask = torch.zeros(len(batch), SRC, dtype=torch.long)
    labels = torch.full((len(batch), TGT), -100)
    for i, (s, t) in enumerate(batch):
        src[i, : len(s)], mask[i, : len(s)], labels[i, : len(t)] = s, 1, t
    return {"input_ids": src, "attention_mask": mask, "labels": labels}


class Seq2Seq(L.LightningModule):
    def __init__(self, model: T5ForConditionalGeneration) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


L.seed_everything(0)
config = T5Config(vocab_size=VOCAB_SIZE, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                  num_heads=4, dropout_rate=0.0, pad_token_id=PAD, decoder_start_token_id=PAD,
                  feed_forward_proj="relu", initializer_factor=0.05)
model = Seq2Seq(T5ForConditionalGeneration(config))
loader = DataLoader(pairs(corpus_text()), batch_size=16, shuffle=True, drop_last=True, collate_fn=collate,
                    generator=torch.Generator().manual_seed(0))
trainer = L.Trainer(strategy="uniap", accelerator="cpu", devices=args.devices, max_steps=args.steps,
                    enable_checkpointing=False, logger=False, log_every_n_steps=5)
trainer.fit(model, loader)
if trainer.is_global_zero:
    print(f"final train loss: {float(trainer.callback_metrics['train_loss']):.4f}")
