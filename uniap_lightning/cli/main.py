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
    if command == "train":
        _exec_with_faithful_cpu_memory(rest)
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


#: glibc's mmap threshold for `uniap train` ranks (bytes): blocks above it are returned to the OS when freed
MMAP_THRESHOLD_BYTES = 65536


def _exec_with_faithful_cpu_memory(rest: list[str]) -> None:
    """Restart this process once with ``MALLOC_MMAP_THRESHOLD_`` set, so the ranks `uniap train` starts inherit it.

    On CPU the monitor's peak memory is local parameters + optimizer state + the step's growth in resident memory.
    By default glibc raises its mmap threshold as blocks are freed, keeps activations of the previous step in its
    heap, and the growth it shows is a fraction of what a step really holds (3.6 MiB for a predicted 13.2 MiB on
    the demo). glibc reads the variable only at process start, hence the restart (``exec``: same process id, so
    srun and the launcher see no difference). Set the variable yourself to keep another value.
    """
    import os

    if sys.platform != "linux" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD_BYTES))
    os.execve(sys.executable, [sys.executable, "-m", "uniap_lightning.cli.main", "train", *rest], env)


if __name__ == "__main__":
    sys.exit(main())
