"""``uniap export CHECKPOINT OUT [--format safetensors|torch|hf] [--hf-config FOLDER]``: a checkpoint folder (what
``Trainer(strategy="uniap")`` saves, resharded from any plan) as full weights for other programs: one safetensors
file (default), one ``torch.save`` file, or a Hugging Face folder that ``from_pretrained`` loads. One process, no
GPU, nothing in the checkpoint runs code (the resume's safe reader)."""

from __future__ import annotations

import argparse
import sys

from uniap_lightning.errors import UniAPError


def main(argv: list[str]) -> int:
    # cli.main imports this module for `uniap --help` too, which runs without torch
    from uniap_lightning.runtime.checkpoint import consolidate_checkpoint  # deferred: loads torch
    from uniap_lightning.runtime.export import FORMATS, check_destination, resolve_format  # deferred: loads torch

    p = argparse.ArgumentParser(prog="uniap export", description=(
        "A checkpoint folder (what Trainer(strategy='uniap') saves, under any plan) as full weights: one safetensors "
        "file (default), one torch.save file, or a Hugging Face folder that from_pretrained loads. One process; "
        "nothing in the checkpoint runs code."))
    p.add_argument("checkpoint", help="a checkpoint folder (e.g. checkpoints/step-00000030.ckpt, written by `uniap train` on SIGTERM)")
    p.add_argument("out", help="the weights file, or the folder for --format hf")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="default: torch for a .pt/.pth/.bin/.ckpt name, else safetensors")
    p.add_argument("--hf-config", default=None, metavar="FOLDER",
                   help="--format hf: the Hugging Face folder the run started from (its config.json is copied)")
    args = p.parse_args(argv)
    try:
        # an unwritable destination is refused before the checkpoint is read (which can take minutes)
        check_destination(args.out, resolve_format(args.out, args.format))
        consolidate_checkpoint(args.checkpoint, args.out, format=args.format, hf_config=args.hf_config)
    except UniAPError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0
