"""A user's own configs, kept outside the package, through every ``uniap`` command.

Two ways, as Hydra users expect them:

* a folder laid out like ``conf/`` (``DIR/model/*.yaml``, ``DIR/cluster/*.yaml``, ``DIR/train/*.yaml``), named
  with ``--config-dir DIR`` or ``hydra.searchpath=[file://DIR]``: its files are chosen by name (``model=mine``),
  after the shipped ones (Hydra's order: shipped, ``--config-dir``, ``hydra.searchpath``);
* a YAML file given as a path, ``model=path/m.yaml cluster=/abs/c.yaml train=t.yaml``, relative to the current
  folder. Hydra chooses group options by name only, so each such file is read once, checked, and registered in
  Hydra's ConfigStore under a name of its own (:func:`register_paths`); ranks that ``uniap train`` starts get the
  original paths again (:func:`original_overrides`).

A missing folder or file is one error line naming it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.config import CONF_DIR, load_group

#: the config groups a user may bring their own entries for
GROUPS = ("model", "cluster", "train")
#: the prefix of the names under which files given as paths are registered in the ConfigStore
REGISTERED_PREFIX = "file_"
#: the ConfigStore entry's provider: this prefix and the file's absolute path, to give started ranks the path again
#: (the entry travels with Hydra's singletons to a launcher's jobs, the path with it)
PROVIDER_PREFIX = "uniap file "


@dataclass(frozen=True)
class SearchPath:
    """The user's config folders of a run, in Hydra's order (``--config-dir``, then ``hydra.searchpath``), and the
    ``pkg://`` entries of ``hydra.searchpath`` (Hydra reads those; names found nowhere else are left to it)."""

    dirs: tuple[Path, ...] = ()
    packages: tuple[str, ...] = ()

    def override(self, overrides: list[str]) -> list[str]:
        """``overrides`` with one ``hydra.searchpath`` naming every entry (for composing outside a Hydra app, where
        ``--config-dir`` is not a flag, and for the ranks `uniap train` starts)."""
        if not (self.dirs or self.packages):
            return list(overrides)
        kept = [o for o in overrides if o.partition("=")[0].lstrip("+~") != "hydra.searchpath"]
        entries = [f"file://{d}" for d in self.dirs] + list(self.packages)
        quoted = ",".join("'" + e.replace("\\", "\\\\").replace("'", "\\'") + "'" for e in entries)
        return [*kept, f"hydra.searchpath=[{quoted}]"]


def search_dirs(config_dir: str | None, overrides: list[str]) -> SearchPath:
    """The search path a command line gives: ``--config-dir``, then ``hydra.searchpath``'s entries. Each folder
    must exist."""
    dirs: list[Path] = []
    packages: list[str] = []
    if config_dir is not None:
        dirs.append(_folder(config_dir, "--config-dir"))
    for entry in _searchpath_entries(overrides):
        if entry.startswith("pkg://"):
            packages.append(entry)
        else:
            dirs.append(_folder(entry[len("file://"):] if entry.startswith("file://") else entry, "hydra.searchpath"))
    return SearchPath(tuple(dirs), tuple(packages))


def _searchpath_entries(overrides: list[str]) -> list[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for override in OverridesParser.create().parse_overrides(overrides):
        if override.get_key_element().lstrip("+~") == "hydra.searchpath":
            value = override.value()
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise UniAPError(f"hydra.searchpath={override.get_value_element_as_str()}: give a list of folders, "
                                 "e.g. hydra.searchpath=[file:///path/to/my_conf]")
            return list(value)
    return []


def _folder(path: str, what: str) -> Path:
    folder = Path(path).expanduser().absolute()
    if not folder.is_dir():
        raise UniAPError(f"{what} {path!r}: no such folder ({folder}); give a folder laid out like conf/ "
                         f"(model/, cluster/, train/ of .yaml files)")
    return folder


#: the providers of the search path entries the user gave (Hydra's names for them)
USER_PROVIDERS = ("command-line", "hydra.searchpath in command-line", "hydra.searchpath in main")


def hydra_search_path() -> SearchPath:
    """Inside a Hydra app: the search path the user gave this run (``--config-dir``, ``hydra.searchpath``); empty
    outside one."""
    from hydra.core.hydra_config import HydraConfig

    try:
        sources = HydraConfig.get().runtime.config_sources
    except ValueError:  # not inside a Hydra app (Python code composing the config itself)
        return SearchPath()
    mine = [s for s in sources if s.provider in USER_PROVIDERS]
    return SearchPath(tuple(Path(s.path) for s in mine if s.schema == "file"),
                      tuple(f"pkg://{s.path}" for s in mine if s.schema == "pkg"))


def strategy_cluster(cluster: Any, dirs: list[Path]) -> Any:
    """``strategy.cluster``: a name found in the user's folders becomes the path of its file (the strategy itself
    knows the shipped names and paths only); anything else is the strategy's to check."""
    if not isinstance(cluster, str) or is_path(cluster) or (CONF_DIR / "cluster" / f"{cluster}.yaml").is_file():
        return cluster
    found = find("cluster", cluster, dirs) if "/" not in cluster else None
    return str(found) if found is not None else cluster


def is_path(value: str) -> bool:
    """A group value that names a YAML file rather than a config by name."""
    return value.endswith((".yaml", ".yml"))


def find(group: str, name: str, dirs: list[Path]) -> Path | None:
    """The file Hydra will compose for ``group=name``: the shipped one, else the first of ``dirs`` that has it.
    None when no folder has it (the shipped names are then the ones to list)."""
    for folder in (CONF_DIR, *dirs):
        path = folder / group / f"{name}.yaml"
        if path.is_file():
            return path
    return None


def available(group: str, dirs: list[Path]) -> list[str]:
    """Every name ``group=`` takes: shipped and in the user's folders."""
    return sorted({p.stem for folder in (CONF_DIR, *dirs) for p in (folder / group).glob("*.yaml")})


def load(group: str, value: str, search: SearchPath) -> dict[str, Any] | None:
    """Read and check one ``group=value`` choice (a name, or a path to a YAML file) as Hydra will compose it; None
    for a name only a ``pkg://`` entry of the search path can hold (Hydra reads it)."""
    dirs = list(search.dirs)
    if is_path(value):
        path = Path(value).expanduser()
        if not path.exists():
            raise UniAPError(f"{group}={value}: no such file ({path.absolute()}); a path is read relative to the "
                             "current folder")
        if not path.is_file():
            raise UniAPError(f"{group}={value}: {path.absolute()} is not a file; give the path of a .yaml file")
        return load_group(group, str(path))
    found = find(group, value, dirs) if "/" not in value and ".." not in value else None
    if found is None and search.packages:
        return None
    if found is None and dirs:
        where = ", ".join(str(d / group) for d in dirs)
        raise UniAPError(f"unknown {group} {value!r}; available: {', '.join(available(group, dirs))} (shipped, and in "
                         f"{where}), or give a path to a .yaml file")
    return load_group(group, str(found) if found is not None else value)


def group_values(overrides: list[str]) -> list[tuple[int, str, list[str]]]:
    """``(index, group, values)`` of each ``model=`` / ``cluster=`` / ``train=`` override: one value, or the
    values of a sweep (``a,b`` or ``choice(a,b)``). ``glob(...)`` and ranges are Hydra's to match against names."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    parser = OverridesParser.create()
    found = []
    for i, arg in enumerate(overrides):
        key, sep, _ = arg.lstrip("+~").partition("=")
        if not sep or key not in GROUPS:
            continue
        value = parser.parse_overrides([arg])[0].value()
        if isinstance(value, ChoiceSweep):
            found.append((i, key, [str(v) for v in value.list]))
        elif isinstance(value, str) and value:
            found.append((i, key, [value]))
    return found


def check_groups(overrides: list[str], search: SearchPath) -> None:
    """Read each group choice once before Hydra composes the config: a missing or broken YAML is then one line."""
    for _, group, values in group_values(overrides):
        for value in values:
            load(group, value, search)


def register_paths(overrides: list[str]) -> list[str]:
    """The overrides with each YAML path replaced by the name it is registered under in Hydra's ConfigStore (the
    file read and checked now, relative to the current folder)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    out = list(overrides)
    for i, group, values in group_values(overrides):
        if not any(is_path(v) for v in values):
            continue
        names = []
        for value in values:
            if not is_path(value):
                names.append(value)
                continue
            path = Path(value).expanduser().absolute()
            data = load(group, value, SearchPath())
            name = f"{REGISTERED_PREFIX}{_safe(path.stem)}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"
            ConfigStore.instance().store(group=group, name=name, node=OmegaConf.create(data),
                                         provider=f"{PROVIDER_PREFIX}{path}")
            names.append(name)
        prefix = overrides[i][: len(overrides[i]) - len(overrides[i].lstrip("+~"))]
        listed = ",".join(names)
        out[i] = f"{prefix}{group}=" + (f"choice({listed})" if overrides[i].partition("=")[2].startswith("choice(")
                                         else listed)
    return out


def _safe(stem: str) -> str:
    return "".join(c if c.isascii() and (c.isalnum() or c in "_-") else "_" for c in stem)[:40] or "config"


def original_overrides(overrides: list[str]) -> list[str]:
    """The command line as the user gave it: each registered name back to the path it stands for (for the ranks
    `uniap train` starts, and for the command printed to resume)."""
    out = []
    for arg in overrides:
        key, sep, value = arg.partition("=")
        group = key.lstrip("+~")
        if sep and group in GROUPS and REGISTERED_PREFIX in value:
            arg = f"{key}={','.join(_registered_path(group, v) or v for v in value.split(','))}"
        out.append(arg)
    return out


def _registered_path(group: str, name: str) -> str | None:
    """The path of the file registered as ``group/name`` by :func:`register_paths`, else None."""
    from hydra.core.config_store import ConfigStore

    if not name.startswith(REGISTERED_PREFIX):
        return None
    try:
        node = ConfigStore.instance().load(f"{group}/{name}.yaml")
    except Exception:  # noqa: BLE001 - ConfigLoadError: not an entry of ours
        return None
    provider = node.provider or ""
    return provider[len(PROVIDER_PREFIX):] if provider.startswith(PROVIDER_PREFIX) else None
