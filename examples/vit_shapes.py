"""A small Vision Transformer on a generated image set, as an nn.Sequential chain (zero glue), with
Trainer(strategy="uniap").

    python examples/vit_shapes.py --devices 2 --steps 60
"""

import argparse

import lightning as L
import torch
from torch import nn

from uniap_lightning.data import ShapesDataModule


class PatchEmbed(nn.Module):
    def __init__(self, dim: int, patch: int = 4, image: int = 32) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, (image // patch) ** 2, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2) + self.pos


class Head(nn.Module):
    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x.mean(dim=1)))


class ViT(L.LightningModule):
    def __init__(self, dim: int = 64, depth: int = 4, heads: int = 4, classes: int = 4) -> None:
        super().__init__()
        blocks = [nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
                  for _ in range(depth)]
        self.net = nn.Sequential(PatchEmbed(dim), *blocks, Head(dim, classes))  # the chain the planner splits
        self.loss_fn = nn.CrossEntropyLoss()

    def training_step(self, batch, batch_idx):  # used without UniAP; the strategy runs the chain itself
        x, y = batch
        return self.loss_fn(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    L.seed_everything(0)
    trainer = L.Trainer(strategy="uniap", accelerator="cpu", devices=args.devices, max_steps=args.steps,
                        log_every_n_steps=5, enable_checkpointing=False, logger=False, limit_val_batches=2)
    trainer.fit(ViT(), ShapesDataModule(batch_size=32))
    if trainer.is_global_zero:
        print(f"final train loss: {float(trainer.callback_metrics['train_loss']):.4f}")
