"""Bounds on a YAML document before a loader builds it (see :func:`uniap_lightning.files.check_yaml_limits`).

A YAML loader follows aliases by building the aliased node again wherever it is used, so a 1 kB document of nine
anchors, each listing the previous one nine times (a "billion laughs"), builds 1e9 nodes and runs until killed.
OmegaConf's ``${...}`` interpolations can do the same with strings. This module measures what a document expands
to without expanding it: PyYAML's composer shares each aliased node, so counting with memoization over shared nodes
takes time linear in the document; interpolations are sized the same way over the (now bounded) loaded data.
"""

from __future__ import annotations

import os
import re
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.limits import MAX_NESTING_DEPTH, MAX_YAML_INTERPOLATED_CHARS, MAX_YAML_NODES

_REFERENCE = re.compile(r"\$\{([^${}]*)\}")
_KEY_PART = re.compile(r"[^.\[\]]+")


def check(text: str, named: str) -> None:
    """Refuse ``text`` (``named`` starts the message) if it nests too deep, expands to too many nodes, has an
    alias to itself, or interpolates too much. Malformed YAML passes: the caller's loader reports it with a line
    number."""
    import yaml

    loader = yaml.SafeLoader  # the pure-Python parser: iterative at any depth (libyaml stops at 1000 levels)
    try:
        _check_events(yaml.parse(text, Loader=loader), named)  # iterative: safe at any depth
        root = yaml.compose(text, Loader=loader)  # recursive, but the depth is now known to be small
    except yaml.YAMLError:  # malformed: the caller's loader reports it, with the line
        return
    if root is None:
        return
    _Nodes(named).measure(root, 1)
    if "${" in text:
        try:
            data = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader, on a document now known to be small
        except Exception:  # noqa: BLE001 - e.g. a 5000-digit integer (ValueError): the caller's loader reports it
            return
        _Interpolations(data, named).check(len(text))


def _check_events(events: Any, named: str) -> None:
    """Nesting depth and node count as written (before aliases are followed), from the parser's event stream."""
    import yaml

    depth = nodes = 0
    for event in events:
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > MAX_NESTING_DEPTH:
                raise UniAPError(f"{named} nests lists / mappings deeper than {MAX_NESTING_DEPTH} levels")
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1
        if isinstance(event, yaml.NodeEvent):
            nodes += 1
            if nodes > MAX_YAML_NODES:
                raise UniAPError(f"{named} has more than {MAX_YAML_NODES:,} nodes; larger documents are not read")


class _Nodes:
    """Expanded node count and height of a composed document, memoized per node object (aliases share theirs)."""

    def __init__(self, named: str) -> None:
        self.named = named
        self.known: dict[int, tuple[int, int]] = {}  # id(node) -> (nodes it expands to, its height)
        self.on_path: set[int] = set()  # ids of the nodes being measured (an alias back to one is a cycle)

    def measure(self, node: Any, depth: int) -> tuple[int, int]:
        """``(nodes, height)`` of ``node``, found at nesting ``depth``; refused past the limits."""
        key = id(node)
        if key in self.on_path:
            raise UniAPError(f"{self.named} has an alias that refers to itself (line {node.start_mark.line + 1})")
        count, height = self.known.get(key) or (0, depth)  # (0, depth): not measured yet, and already too deep?
        if depth - 1 + height <= MAX_NESTING_DEPTH and not count:
            count, height = self._expand(node, depth)
        if depth - 1 + height > MAX_NESTING_DEPTH:  # aliases stacked on aliases nest deeper than the text shows
            raise UniAPError(f"{self.named} nests lists / mappings deeper than {MAX_NESTING_DEPTH} levels once its "
                             "aliases are followed")
        return count, height

    def _expand(self, node: Any, depth: int) -> tuple[int, int]:
        key = id(node)
        self.on_path.add(key)
        count, height = 1, 1
        for child in _children(node):
            c, h = self.measure(child, depth + 1)
            count, height = count + c, max(height, h + 1)
        self.on_path.discard(key)
        if count > MAX_YAML_NODES:
            raise UniAPError(f"{self.named} expands to more than {MAX_YAML_NODES:,} nodes once its aliases are "
                             "followed (an alias bomb?); larger documents are not read")
        self.known[key] = (count, height)
        return count, height


def _children(node: Any) -> list[Any]:
    import yaml

    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


class _Interpolations:
    """Characters the document holds once every ``${...}`` is resolved, computed per key path with memoization:
    ``${a}`` counts as the size of ``a``, a resolver's arguments as the keys they name (or their own text), and
    ``${oc.env:VAR}`` as the variable's value."""

    def __init__(self, data: Any, named: str) -> None:
        self.data, self.named = data, named
        self.size: dict[tuple, int] = {}
        self.on_path: set[tuple] = set()
        self.limit = MAX_YAML_INTERPOLATED_CHARS

    def check(self, text_chars: int) -> None:
        self.limit += text_chars
        if self.measure(()) > self.limit:
            raise UniAPError(f"{self.named}: its ${{...}} interpolations resolve to more than "
                             f"{MAX_YAML_INTERPOLATED_CHARS // 2**20} MiB of text (an interpolation bomb?)")

    def measure(self, path: tuple) -> int:
        if path in self.size:
            return self.size[path]
        if path in self.on_path:
            raise UniAPError(f"{self.named}: the interpolation at {_dotted(path)} refers to itself")
        self.on_path.add(path)
        node = _lookup(self.data, path)
        if isinstance(node, dict):
            total = 2 + sum(len(str(k)) + 2 + self.measure(path + (k,)) for k in node)
        elif isinstance(node, list):
            total = 2 + sum(2 + self.measure(path + (i,)) for i in range(len(node)))
        elif isinstance(node, str):
            total = self._string(node, path)
        else:
            total = len(str(node))
        self.on_path.discard(path)
        self.size[path] = total = min(total, self.limit + 1)  # past the limit the exact figure does not matter
        return total

    def _string(self, text: str, path: tuple) -> int:
        text = text.replace("\\${", "")  # an escaped "${" is literal text
        total = len(text)
        for match in _REFERENCE.finditer(text):
            total += self._reference(match.group(1).strip(), path)
            if total > self.limit:
                return total
        if "${" in _REFERENCE.sub("", text):
            raise UniAPError(f"{self.named}: {_dotted(path)} nests one ${{...}} interpolation in another; only "
                             "plain ${key} and ${resolver:arguments} interpolations are read")
        return total

    def _reference(self, inner: str, path: tuple) -> int:
        name, colon, args = inner.partition(":")
        if not colon:
            return self._key_size(inner, path)
        total = 0
        for arg in args.split(","):
            arg = arg.strip()
            total += max(self._key_size(arg, path), len(arg))
        if name.strip() == "oc.env":
            total += len(os.environ.get(args.split(",")[0].strip(), ""))
        return total

    def _key_size(self, key: str, path: tuple) -> int:
        """The size of the node ``key`` names from ``path`` (``.x`` relative), 0 when it names none."""
        dots = len(key) - len(key.lstrip("."))
        base = path[: max(len(path) - dots, 0)] if dots else ()
        target = base + tuple(_KEY_PART.findall(key[dots:]))
        resolved = _resolve(self.data, target)
        return self.measure(resolved) if resolved is not None else 0


def _lookup(data: Any, path: tuple) -> Any:
    for key in path:
        data = data[key]
    return data


def _resolve(data: Any, parts: tuple) -> tuple | None:
    """The key path (with the document's own key types) that ``parts`` (strings) names, or None."""
    out: list[Any] = []
    for part in parts:
        if isinstance(data, dict):
            key = part if part in data else int(part) if part.isdigit() and int(part) in data else _MISSING
            if key is _MISSING:
                return None
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data):
            key = int(part)
        else:
            return None
        out.append(key)
        data = data[key]
    return tuple(out)


_MISSING = object()


def _dotted(path: tuple) -> str:
    return ".".join(map(str, path)) or "the top level"
