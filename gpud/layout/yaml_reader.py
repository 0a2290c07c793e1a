"""A line-numbered YAML reader: text -> nodes, and the shapes a grammar asks of them, each problem
reported by file, line and key path.

Why not `yaml.safe_load` + msgspec.convert: the loaded dicts forget line numbers, duplicate keys
silently overwrite, and YAML 1.1 re-types unquoted values (`0x233010DE` becomes an int,
`0000:00:01.0` a sexagesimal *float*). So the text is composed into nodes (`yaml.compose`), which
keep each key's line and the scalar exactly as written, and a grammar (gpud.layout.parse, layout.yaml
v1) validates them by hand through `NodeReader`, with messages that say what was expected. Nothing
here raises on bad input except `TooLarge`, which the grammar's caller turns into one error.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterator

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from gpud.layout.desired import LayoutIssue

_TAG = "tag:yaml.org,2002:"
STR, INT, FLOAT, BOOL, NULL, MERGE = (_TAG + t for t in ("str", "int", "float", "bool", "null", "merge"))

_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")
SCALARS = SafeConstructor()  # converts one scalar node at a time; keeps no state between calls

# Aliases let a short file stand for a huge tree (`[*a, *a, ...]` nested); the validator stops
# after visiting this many values rather than spend quadratic time on a `check` request.
MAX_NODES = 100_000


class TooLarge(Exception):
    pass


class _CountingLoader(yaml.SafeLoader):
    """yaml's safe composer, counting the aliases it resolves: only they make a short text a huge
    tree, and the "too large" error must say which kind of large it is."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.aliases = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
        return super().compose_node(parent, index)


def key_path(parent: str, key: str) -> str:
    """`parent.key`; keys other than [A-Za-z0-9_-]+ are quoted: `mig-devices."1g.10gb"`."""
    part = key if _PLAIN_KEY.fullmatch(key) else json.dumps(key)
    return f"{parent}.{part}" if parent else part


def item_path(parent: str, index: int) -> str:
    return f"{parent}[{index}]"


def line_of(node: Node) -> int:
    return node.start_mark.line + 1


def quote(text: str, limit: int = 60) -> str:
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return json.dumps(text)


def got(node: Node) -> str:
    """How a node reads in `expected X, got Y`."""
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    if not isinstance(node, ScalarNode):  # pragma: no cover - yaml only makes these three
        return "an unknown node"
    if node.tag == NULL:
        return "nothing"
    if node.tag in (INT, FLOAT, BOOL) and node.style is None:
        return node.value if len(node.value) <= 60 else quote(node.value)
    return quote(node.value)


def is_null(node: Node) -> bool:
    return isinstance(node, ScalarNode) and node.tag == NULL


def one_of(values: tuple[str, ...]) -> str:
    return ", ".join(values)


_PLAIN_DECIMAL = re.compile(r"[-+]?(0|[1-9][0-9]*)")


def yaml11_note(node: Node) -> str:
    """What YAML 1.1 would have made of a non-decimal int, so the error says what was read."""
    if not (isinstance(node, ScalarNode) and node.tag == INT) or _PLAIN_DECIMAL.fullmatch(node.value.strip()):
        return ""
    try:
        meant = SCALARS.construct_yaml_int(node)
    except Exception:  # noqa: BLE001 - `!!int abc`: not a number at all, the plain message says so
        return ""
    return f" in plain decimal (YAML 1.1 would read {node.value.strip()!r} as {meant})"


class NodeReader:
    """Reads YAML nodes for a grammar: the shapes (a mapping of known keys, a list, a string, an
    enum, a boolean, a plain decimal count), each mismatch an error at the node's line and key path.
    `lines` maps each key path read to its line; `budget` bounds the values visited (`TooLarge`)."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.limit = MAX_NODES
        self.budget = self.limit
        self.aliases = 0  # aliases in the text (set once it is composed)
        self.errors: list[LayoutIssue] = []
        self.lines: dict[str, int] = {}

    def compose(self, text: str, *, empty: str) -> Node | None:
        """The text's root node; None with the error reported (`empty` is the message for no node)."""
        if not isinstance(text, str):
            self.error(None, "", f"expected text, got {type(text).__name__}")
            return None
        loader: _CountingLoader | None = None
        try:
            loader = _CountingLoader(text)  # its reader already refuses control characters
            root = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            problem = ", ".join(p for p in (exc.context, exc.problem) if p) or "syntax error"
            self.error(mark.line + 1 if mark else None, "", f"invalid YAML: {problem}")
            return None
        except yaml.YAMLError as exc:  # e.g. ReaderError: a control character
            self.error(None, "", f"invalid YAML: {exc}")
            return None
        except RecursionError:
            self.error(None, "", "invalid YAML: nested too deeply")
            return None
        finally:
            if loader is not None:
                self.aliases = loader.aliases
                loader.dispose()
        if root is None:
            self.error(None, "", empty)
        return root

    # -- reporting -------------------------------------------------------------------------------

    def error(self, node: Node | int | None, path: str, message: str) -> None:
        line = line_of(node) if isinstance(node, Node) else node
        self.errors.append(LayoutIssue(self.file, line, path, message))

    def expected(self, node: Node, path: str, what: str) -> None:
        self.error(node, path, f"expected {what}, got {got(node)}")

    # -- generic shapes --------------------------------------------------------------------------

    def mapping(
        self, node: Node, path: str, allowed: tuple[str, ...], what: str = "a mapping"
    ) -> dict[str, tuple[Node, Node]] | None:
        """Known keys of a mapping -> (key node, value node); reports unknown and duplicate keys."""
        if not isinstance(node, MappingNode):
            self.expected(node, path, what)
            return None
        out: dict[str, tuple[Node, Node]] = {}
        for name, kpath, key, value in self._unique_pairs(node, path):
            if name not in allowed:
                hint = difflib.get_close_matches(name, allowed, n=1)
                did = f'; did you mean "{hint[0]}"?' if hint else ";"
                self.error(key, kpath, f"unknown key {quote(name)}{did} allowed: {one_of(allowed)}")
                continue
            out[name] = (key, value)
            self.lines[kpath] = line_of(key)
        return out

    def free_mapping(self, node: Node, path: str, what: str) -> Iterator[tuple[str, Node, Node]]:
        """Every (key, key node, value node) of a mapping whose keys are data (names, not fields)."""
        if not isinstance(node, MappingNode):
            self.expected(node, path, what)
            return
        for name, kpath, key, value in self._unique_pairs(node, path):
            self.lines[kpath] = line_of(key)
            yield name, key, value

    def _unique_pairs(self, node: MappingNode, path: str) -> Iterator[tuple[str, str, Node, Node]]:
        """(name, key path, key node, value node) of a mapping, each key once; a repeated key is
        an error (YAML would silently keep the last), except one brought in by a merge key."""
        first: dict[str, int] = {}
        for key, value, merged in self._pairs(node, path):
            name = key.value
            kpath = key_path(path, name)
            if name in first:
                if not merged:
                    self.error(key, kpath, f"duplicate key (first at line {first[name]})")
                continue
            first[name] = line_of(key)
            yield name, kpath, key, value

    def _spend(self, n: int) -> None:
        self.budget -= n
        if self.budget < 0:
            raise TooLarge

    def _pairs(self, node: MappingNode, path: str) -> list[tuple[ScalarNode, Node, bool]]:
        """Key/value pairs with YAML merge keys (`<<: *base`) applied: own keys first, then merged
        ones (which the caller ignores when already present), flagged so they are not duplicates."""
        self._spend(len(node.value) + 1)
        own: list[tuple[ScalarNode, Node, bool]] = []
        merged: list[tuple[ScalarNode, Node, bool]] = []
        for key, value in node.value:
            if isinstance(key, ScalarNode) and key.tag == MERGE:
                merged.extend(self._merged(value, path, {id(node)}))
            elif not isinstance(key, ScalarNode) or key.tag == NULL:
                self.error(key, path, f"keys must be plain names, got {got(key)}")
            else:
                own.append((key, value, False))
        return own + merged

    def _merged(self, value: Node, path: str, seen: set[int]) -> list[tuple[ScalarNode, Node, bool]]:
        sources = value.value if isinstance(value, SequenceNode) else [value]
        out: list[tuple[ScalarNode, Node, bool]] = []
        self._spend(len(sources))
        for src in sources:
            if not isinstance(src, MappingNode):
                self.error(src, path, f"a merge key (<<) takes a mapping or a list of mappings, got {got(src)}")
                continue
            if id(src) in seen:
                continue  # a mapping merged into itself through an alias
            for key, val in src.value:
                if isinstance(key, ScalarNode) and key.tag == MERGE:
                    out.extend(self._merged(val, path, seen | {id(src)}))
                elif isinstance(key, ScalarNode) and key.tag != NULL:
                    out.append((key, val, True))
        return out

    def sequence(self, node: Node, path: str, what: str) -> list[tuple[str, Node]] | None:
        if not isinstance(node, SequenceNode):
            self.expected(node, path, what)
            return None
        self._spend(len(node.value) + 1)
        items = []
        for i, item in enumerate(node.value):
            ipath = item_path(path, i)
            self.lines[ipath] = line_of(item)
            items.append((ipath, item))
        return items

    def string(self, node: Node, path: str, what: str = "a string") -> str | None:
        if isinstance(node, ScalarNode) and node.tag == STR:
            return node.value
        self.expected(node, path, what)
        return None

    def text(self, node: Node, path: str, what: str) -> str | None:
        """Any non-null scalar as written: `args: [-n, 5]` means the text "5", not the int 5."""
        if isinstance(node, ScalarNode) and node.tag != NULL:
            return node.value
        self.expected(node, path, what)
        return None

    def enum(self, node: Node, path: str, allowed: tuple[str, ...]) -> str | None:
        if isinstance(node, ScalarNode) and node.tag == STR and node.value in allowed:
            return node.value
        self.expected(node, path, f"one of {one_of(allowed)}")
        return None

    def boolean(self, node: Node, path: str) -> bool | None:
        if isinstance(node, ScalarNode) and node.tag == BOOL:
            try:
                return bool(SCALARS.construct_yaml_bool(node))
            except Exception:  # noqa: BLE001 - `!!bool maybe`
                pass
        self.expected(node, path, "true or false")
        return None

    def integer(self, node: Node) -> int | None:
        """The int a scalar denotes, or None; no reporting (callers word their own message).

        Plain decimal only: YAML 1.1 also reads `010` as octal 8, `1_0` as 10, `0x1f`, `0b11` and
        `1:30` (sexagesimal) as ints, which nobody means in a GPU index or a count.
        """
        if isinstance(node, ScalarNode) and node.tag == INT:
            if not _PLAIN_DECIMAL.fullmatch(node.value.strip()):
                return None
            try:
                value = SCALARS.construct_yaml_int(node)
            except Exception:  # noqa: BLE001 - `!!int abc`
                return None
            return value if isinstance(value, int) and not isinstance(value, bool) else None
        return None

    def count(self, node: Node, path: str) -> int | None:
        value = self.integer(node)
        if value is None or value < 0:
            self.expected(node, path, "a count >= 0" + yaml11_note(node))
            return None
        return value
