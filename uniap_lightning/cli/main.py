"""``uniap <command> [hydra overrides]``: dispatch to the Hydra app of each command."""

from __future__ import annotations

import sys

from uniap_lightning.cli import export, interrupts
from uniap_lightning.errors import UniAPError

USAGE = """usage: uniap <command> [key=value ...] [-m]

commands:
  plan       find the best plan for a model on a cluster      uniap plan model=llama_7b cluster=h100_4x8
  evaluate   score a given plan file (what-if)                  uniap evaluate plan=plan.json model=... cluster=...
  train      train a shipped GPT on the shipped corpus with Trainer(strategy="uniap")
             uniap train model=tiny_gpt trainer.devices=2 trainer.max_steps=30
  explain    per-layer / per-stage predictions (and measurements), and why the other candidates lost
             uniap explain model=... cluster=... [plan=plan.json] [measured=metrics.json]
  export     a checkpoint folder as full weights: safetensors, torch, or a Hugging Face folder
             uniap export checkpoints/step-00000030.ckpt model.safetensors [--format hf --hf-config FOLDER]
             (checkpoints/step-<N>.ckpt, N in 8 digits: what `uniap train` writes on SIGTERM, e.g. `timeout -s
             TERM 60 uniap train ...`; a run that ends by itself writes none)

Every option is a Hydra override; `uniap <command> --help` lists them with types and defaults, `-m`
sweeps (multirun):
  uniap plan -m model=gpt2_small,llama_7b cluster=a100_1x8,h100_4x8
Exit status: 0 done; 2 refused or failed (a bad option, no plan fits, a training run that failed); 3 `uniap
evaluate`'s plan does not fit memory. A sweep prints its summary, then exits with its worst job's status;
allow_no_plan=true (plan, evaluate, explain) makes "no plan fits" an answer, status 0.
Models: conf/model/*.yaml, clusters: conf/cluster/*.yaml, training settings: conf/train/*.yaml.
Your own: a folder laid out the same way (`uniap plan --config-dir my_conf model=mine`, or
hydra.searchpath=[file://my_conf]), or a file given as a path (model=my/model.yaml cluster=c.yaml).
"""


COMMANDS = ("plan", "evaluate", "explain", "train", "export")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"uniap: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    if command != "export" and any(arg in ("-h", "--help") for arg in rest):  # export: argparse's own help
        from uniap_lightning.cli.help_text import print_help  # deferred: loads hydra, omegaconf, rich: the schemas

        return print_help(command, rest)
    interrupts.install()
    try:
        return _run(command, rest)
    except KeyboardInterrupt:
        _stop_interrupted()
    except SystemExit as stop:
        if stop.code not in (0, None) and interrupts.interrupted():  # Lightning ends a Ctrl-C'd fit with exit(1)
            _stop_interrupted()
        raise
    return 0  # not reached: _stop_interrupted ends the process


def _run(command: str, rest: list[str]) -> int:
    if command == "export":  # plain arguments, no Hydra config
        return export.main(rest)
    from uniap_lightning.cli.overrides import check_command_line  # deferred: loads omegaconf and the planner

    try:
        rest = check_command_line(command, rest)
    except UniAPError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from uniap_lightning.cli import apps  # deferred: loads hydra, omegaconf and rich; `uniap export` doesn't

    apps.quiet_solver_banner()
    table = {"plan": apps.plan_main, "evaluate": apps.evaluate_main, "explain": apps.explain_main,
             "train": apps.train_main}
    sys.argv = [f"uniap-{command}", *rest]
    table[command]()
    return 0


def _stop_interrupted() -> None:
    """Ctrl-C reached the top: one line (unless the first Ctrl-C printed its own), exit status 130 at once (the
    interpreter's teardown would wait for solver threads and process groups)."""
    if not interrupts.hinted() and interrupts.is_launching_rank():
        print("interrupted", file=sys.stderr)
    interrupts.stop_now(interrupts.INTERRUPTED_EXIT_CODE)


if __name__ == "__main__":
    sys.exit(main())
