"""A Hugging Face `transformers` Llama (built from a config, random weights, nothing downloaded) through the
adapter, on the shipped corpus, with Trainer(strategy="uniap").

    pip install -e ".[hf]" && python examples/hf_llama.py --devices 2 --steps 30
"""

import argparse

import lightning as L
from transformers import LlamaConfig, LlamaForCausalLM

from uniap_lightning.adapters import CausalLMModule, hf_layers
from uniap_lightning.data import VOCAB_SIZE, TextDataModule

parser = argparse.ArgumentParser()
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--steps", type=int, default=30)
args = parser.parse_args()

L.seed_everything(0)
config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = CausalLMModule(hf_layers(LlamaForCausalLM(config)), lr=3e-3)  # the adapter: a few lines
trainer = L.Trainer(strategy="uniap", accelerator="cpu", devices=args.devices, max_steps=args.steps,
                    enable_checkpointing=False, logger=False, limit_val_batches=2, log_every_n_steps=5)
trainer.fit(model, TextDataModule(seq_len=64, batch_size=16, shuffle=True))
if trainer.is_global_zero:
    print(f"final train loss: {float(trainer.callback_metrics['train_loss']):.4f}")
