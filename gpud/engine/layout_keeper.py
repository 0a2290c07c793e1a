"""The layout file as the engine holds it: read, parsed and resolved against this host, and taken
only when it has no errors. A bad file (missing, unreadable, invalid, naming GPUs or profiles the
host does not have) never replaces the last good layout: gpud keeps applying that one and reports
the file's problems until it is fixed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gpud.engine.events import EventBus
from gpud.engine.observe import Observation
from gpud.layout.match import DEFAULT_MATCH
from gpud.layout.parse import ParsedLayout, parse_layout
from gpud.layout.resolve import Resolution, resolve
from gpud.layout.schema import MatchRule


class LayoutKeeper:
    """`layout` is the last good layout in force (None before the first good read); `issues` are
    the (errors, warnings) of the file as it is now. `observe(match)` reads the host's GPUs as a
    layout's `match:` selects them."""

    def __init__(self, path: str, bus: EventBus,
                 observe: Callable[[tuple[MatchRule, ...]], Observation]) -> None:
        self.path = path
        self.bus = bus
        self.observe = observe
        self.layout: ParsedLayout | None = None
        self.issues: tuple[list[str], list[str]] = ([], [])

    def load(self) -> bool:
        """Read and parse the file; a bad file never replaces the last good layout."""
        try:
            text = Path(self.path).read_text()
        except FileNotFoundError:
            self.issues = ([f"{self.path}: file not found; keeping the last good layout"], [])
            self.bus.publish("layout-invalid", self.issues[0][0])
            return False
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) else f"not UTF-8 text ({e.reason} at byte {e.start})"
            self.issues = ([f"{self.path}: {why}; keeping the last good layout"], [])
            self.bus.publish("layout-invalid", self.issues[0][0])
            return False
        parsed, resolution, _ = self.evaluate(text, self.path)
        errors = [str(i) for i in resolution.errors]  # parse errors included: one full report
        warnings = [str(i) for i in resolution.warnings]
        if errors:
            self.issues = (errors, warnings)
            self.bus.publish("layout-invalid", f"{len(errors)} error(s); keeping the last good layout",
                             errors=errors)
            return False
        self.layout = parsed
        self.issues = ([], warnings)
        self.bus.publish("layout-loaded", f"{self.path}: selected {parsed.layout.selected!r}")
        return True

    def evaluate(self, text: str, path: str) -> tuple[ParsedLayout, Resolution, Observation]:
        """Parse a layout text and resolve it against this host as that layout's own `match:` sees
        it: selectors and profile names are checked against the real GPUs before the file is taken."""
        parsed = parse_layout(text, path)
        candidate = parsed.layout or parsed.draft
        match = candidate.match if candidate is not None and candidate.match else DEFAULT_MATCH
        obs = self.observe(match)
        return parsed, resolve(parsed, obs.gpus), obs

    @property
    def match(self) -> tuple[MatchRule, ...]:
        """Which PCI functions the layout in force manages (gpud's default before there is one)."""
        if self.layout is not None and self.layout.layout is not None and self.layout.layout.match:
            return self.layout.layout.match
        return DEFAULT_MATCH
