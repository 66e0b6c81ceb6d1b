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
    if not _config_groups_load(rest):
        return 2
    sys.argv = [f"uniap-{command}", *rest]
    table[command]()
    return 0


def _config_groups_load(overrides: list[str]) -> bool:
    """Read each ``model=`` / ``cluster=`` / ``train=`` choice once before Hydra composes the config: a missing or
    broken YAML is then one ``error:`` line (Hydra would print its own traceback)."""
    from uniap_lightning.errors import UniAPError
    from uniap_lightning.planner.config import load_group

    for arg in overrides:
        key, sep, value = arg.lstrip("+~").partition("=")
        if not sep or key not in ("model", "cluster", "train") or not value:
            continue
        for name in value.split(","):  # a multirun sweep lists several
            try:
                load_group(key, name.strip())
            except UniAPError as err:
                print(f"error: {err}", file=sys.stderr)
                return False
    return True


if __name__ == "__main__":
    sys.exit(main())
