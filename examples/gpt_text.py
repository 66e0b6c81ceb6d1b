"""A plain-PyTorch GPT on the shipped text corpus, trained with Trainer(strategy="uniap").

    python examples/gpt_text.py --devices 4 --steps 100
"""

import argparse

import lightning as L

from uniap_lightning.adapters import CausalLMModule
from uniap_lightning.adapters.gpt import GPT, GPTConfig
from uniap_lightning.callbacks import PerplexityLogger
from uniap_lightning.data import VOCAB_SIZE, TextDataModule

parser = argparse.ArgumentParser()
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--steps", type=int, default=50)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--batch-size", type=int, default=16)
args = parser.parse_args()

L.seed_everything(0)
gpt = GPT(GPTConfig(vocab_size=VOCAB_SIZE, block_size=64, n_layer=args.layers, n_head=4, n_embd=64))
model = CausalLMModule(gpt.layers(), lr=3e-3)
data = TextDataModule(seq_len=64, batch_size=args.batch_size, shuffle=True)

trainer = L.Trainer(strategy="uniap", accelerator="cpu", devices=args.devices, max_steps=args.steps,
                    callbacks=[PerplexityLogger()], log_every_n_steps=5, val_check_interval=20, limit_val_batches=4,
                    enable_checkpointing=False, logger=False)
trainer.fit(model, data)
if trainer.is_global_zero:
    print(f"final train loss: {float(trainer.callback_metrics['train_loss']):.4f}")
