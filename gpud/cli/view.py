"""gpudctl's replies: the MessagePack maps gpud sent, read by attribute as the wire structs define them.

Why not the structs themselves: importing msgspec (with typing, enum, re, uuid, datetime and
decimal) was most of a `gpudctl status` (bench/results/client_startup.md), and the client's
start-up is a product feature. The daemon encodes each reply struct (gpud.wire.replies,
gpud.wire.tables) as a map of every field by its wire name, nested structs as maps and lists as
arrays, omitting nothing (no omit_defaults, tags or array_like there: gpud.wire.protocol); `msgpack`
decodes that into the values msgspec's typed decode holds. A `Reply` is such a map whose keys read
as attributes, so the render code reads from it exactly what it read from the struct
(tests/cli/test_view.py and tests/daemon/test_client_view.py compare every command's output both ways).

The structs stay the one definition of the replies. The client's functions are annotated with
them (under TYPE_CHECKING: mypy checks every attribute the client reads against them), and a map
that lacks a field (sent by a gpud older than the field) gets the struct's own default: only then
are gpud.wire.replies and msgspec imported. A field missing without a default is a malformed
reply (FrameError), as msgspec's decode said.

A number is what gpud wrote: msgspec's decode made an int in a float field a float (`0.0` in
--json where gpud wrote `0`), the view leaves it an int; the text gpudctl prints is the same, and so
is the JSON number.

Two rules keep attribute reads exact: a field named after a Python keyword has a trailing
underscore in the struct (`class_`) and the bare word on the wire (`class`); and no field is
named like a dict method (`items`, `get`...), which would win over the key. tests/cli/test_view.py
holds every struct to both.
"""

from __future__ import annotations

from gpud.cli.escape import MULTILINE, term

TYPE_CHECKING = False
if TYPE_CHECKING:  # `typing` itself is a cost every run would pay
    from typing import Any

EVENT = "(event)"  # the root of an event frame's event, which answers no op


class Reply(dict):
    """One struct of a reply as gpud sent it: a dict (as --json prints it) whose keys are also its
    attributes. `_at`: the op whose result it is part of, and the wire names leading to it."""

    __slots__ = ("_at",)

    _at: tuple[str, tuple[str, ...]]

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            pass
        if name.endswith("_") and name[:-1] in self:  # `class_` is "class" on the wire
            return self[name[:-1]]
        if name.startswith("__") or name == "_at":  # copy, pickle and the like probe for these
            raise AttributeError(name)
        return _missing(self, name)


def reply(root: str, value: Any, *, escape: bool = False) -> Any:
    """`value` (the decoded result of op `root`, or an event for EVENT) with every map a Reply;
    `escape`: every string in it, map keys too, made safe for a terminal (gpud.cli.escape)."""
    return _wrap(value, root, (), escape)


def _wrap(value: Any, root: str, path: tuple[str, ...], escape: bool) -> Any:
    if isinstance(value, dict):
        r = Reply()
        for k, v in value.items():
            if isinstance(v, (dict, list)):
                v = _wrap(v, root, (*path, k), escape)
            elif escape and isinstance(v, str):
                v = term(v, lines=k in MULTILINE)
            r[term(k) if escape and isinstance(k, str) else k] = v
        r._at = (root, path)
        return r
    if isinstance(value, list):
        return [_wrap(v, root, path, escape) if isinstance(v, (dict, list))
                else term(v) if escape and isinstance(v, str) else v for v in value]
    if escape and isinstance(value, str):
        return term(value)
    return value


def _missing(r: Reply, name: str) -> Any:
    """A field `r` lacks: the struct's default (kept in `r` from then on), found by the path to `r`
    from its op's result struct. The only place the client imports msgspec and the structs."""
    import msgspec

    from gpud.wire import frames

    root, path = r._at
    struct = _struct_at(root, path)
    if struct is None:  # inside a field typed `dict[str, Any]`: no struct says what belongs there
        raise AttributeError(name)
    field = next((f for f in msgspec.structs.fields(struct) if f.name == name), None)
    if field is None:
        raise AttributeError(f"{struct.__name__} has no field {name!r}")
    if field.default is not msgspec.NODEFAULT:
        value = field.default
    elif field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
    else:
        what = "event" if root == EVENT else f"{root} result"
        raise frames.FrameError(f"malformed {what} from gpud: {'.'.join((*path, field.encode_name))} is missing")
    r[field.encode_name] = shown = _wrap(msgspec.to_builtins(value), root, (*path, field.encode_name), False)
    return shown


def _struct_at(root: str, path: tuple[str, ...]) -> Any:
    """The struct type at `path` (wire names; list items share their list's) of op `root`'s result."""
    import msgspec

    from gpud.wire import protocol, replies

    typ: Any = protocol.Event if root == EVENT else replies.RESULTS[root]
    for key in path:
        typ = _item_type(typ)
        if isinstance(typ, type) and issubclass(typ, msgspec.Struct):
            typ = next((f.type for f in msgspec.structs.fields(typ) if f.encode_name == key), None)
        elif getattr(typ, "__origin__", None) is dict:
            typ = typ.__args__[1]
        else:
            return None
    typ = _item_type(typ)
    return typ if isinstance(typ, type) and issubclass(typ, msgspec.Struct) else None


def _item_type(typ: Any) -> Any:
    """`X` of `list[X]`, `X | None`, `list[X] | None`; anything else as it is."""
    import typing

    while True:
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        origin = typing.get_origin(typ)
        if origin is list or (origin is not dict and len(args) == 1 and origin is not None):
            typ = args[0]
        else:
            return typ
