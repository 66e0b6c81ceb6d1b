"""``uniap <command> [hydra overrides]``: dispatch to the Hydra app of each command."""

from __future__ import annotations

import sys

USAGE = """usage: uniap <command> [key=value ...] [-m]

commands:
  plan       find the best plan for a model on a cluster      uniap plan model=llama_7b cluster=h100_4x8
  evaluate   score a given plan file (what-if)                  uniap evaluate plan=plan.json model=... cluster=...
  train      train a shipped GPT on the shipped corpus with Trainer(strategy="uniap")
             uniap train model=tiny_gpt trainer.devices=2 trainer.max_steps=30
  explain    per-layer / per-stage predictions (and measurements), and why the other candidates lost
             uniap explain model=... cluster=... [plan=plan.json] [measured=metrics.json]

Every option is a Hydra override; `uniap plan --help` lists them, `-m` sweeps (multirun):
  uniap plan -m model=gpt2_small,llama_7b cluster=a100_1x8,h100_4x8
Models: conf/model/*.yaml, clusters: conf/cluster/*.yaml, training settings: conf/train/*.yaml.
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    from uniap_lightning.cli import apps

    table = {"plan": apps.plan_main, "evaluate": apps.evaluate_main, "explain": apps.explain_main,
             "train": apps.train_main}
    if command not in table:
        print(f"uniap: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    sys.argv = [f"uniap-{command}", *rest]
    table[command]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
