"""The layout file as the engine holds it: read, parsed and resolved against this host, and taken
only when it has no errors. A bad file (missing, unreadable, invalid, naming GPUs or profiles the
host does not have) never replaces the last good layout: gpud keeps applying that one and reports
the file's problems until it is fixed.

Reading is bounded (`gpud.host.files.layout_source`: a regular file of at most 1 MiB, never a FIFO or a
device), and the daemon parses and resolves off the event loop (`load_async`, `evaluate_async`),
one text at a time, so a large `check` or file never stops status from being answered or the
systemd watchdog from being pinged. The text of a file that non-root readers of status must not
see (not owned by root, or reached through a link into another tree) is never quoted: its errors
name lines only.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable

import msgspec

from gpud.engine.events import EventBus
from gpud.engine.observe.discovery import Observation
from gpud.host.files.layout_source import LayoutSource, LayoutUnreadable, check_text_size, read_layout
from gpud.layout.desired import LayoutIssue
from gpud.layout.match import DEFAULT_MATCH
from gpud.layout.parse import ParsedLayout, parse_layout
from gpud.layout.resolve import Resolution, resolve
from gpud.layout.schema import HOOK_PHASES, Hooks, MatchRule

# Reads the host's GPUs as a layout's `match:` selects them, off the event loop.
AsyncObserve = Callable[[tuple[MatchRule, ...]], Awaitable[Observation]]
# Adds to a resolution what only the planner knows: the GPUs it cannot converge (engine.feasibility).
Judge = Callable[[ParsedLayout, Resolution, Observation], Resolution]

# Errors carried by one `layout-invalid` event: the event history must stay small enough to send.
EVENT_ERRORS = 20
# resolutions made ahead in reading threads that are kept: one per GPU step running at once, and more
AHEAD_KEPT = 16


def _unquoted(issues: list[str], lines: list[int | None], what: str, why: str, path: str) -> list[str]:
    """Errors of a file whose text must not be shown: how many, at which lines, and why."""
    if not issues:
        return []
    at = sorted({n for n in lines if n})
    where = f" at line(s) {', '.join(map(str, at[:20]))}{' ...' if len(at) > 20 else ''}" if at else ""
    return [f"{path}: {len(issues)} {what}(s){where}; the file's text is not quoted because {why} "
            f"(run `gpudctl check {path}` as a user who may read it)"]


class LayoutKeeper:
    """`layout` is the last good layout in force (None before the first good read); `issues` are
    the (errors, warnings) of the file as it is now. `observe(match)` reads the host's GPUs as a
    layout's `match:` selects them."""

    def __init__(self, path: str, bus: EventBus,
                 observe: Callable[[tuple[MatchRule, ...]], Observation], judge: Judge | None = None, *,
                 label_selects: bool = False,
                 prepare: Callable[[Resolution, Observation], None] | None = None) -> None:
        self.path = path
        self.bus = bus
        self.observe = observe
        self.judge = judge  # every text is judged so: the daemon's file, `check` and `plan` alike
        # run in the worker thread that resolved a text, before the judge runs on the loop: pure
        # work the judge will ask for (the reconciler plans the GPUs there)
        self.prepare = prepare
        self.layout: ParsedLayout | None = None
        # why the hooks of `layout` may not run as root ("" when they may): its file, or a
        # directory above it, is another user's or writable by a group or others
        self.hooks_refused = ""
        self.issues: tuple[list[str], list[str]] = ([], [])
        self._parsing: asyncio.Semaphore | None = None  # one check/plan text parsed at a time (made on the loop)
        self._file_slot: asyncio.Semaphore | None = None  # one load of the file at a time, apart from checks
        self._next_load: asyncio.Future | None = None  # the shared load that has not begun reading yet
        self._load_tasks: set[asyncio.Task] = set()
        self._text: str | None = None  # the text of `layout`, to tell a new load from a re-read
        self.select: str | None = None  # a layout chosen over the file's `selected` (a node label)
        # --kube-node: a node label chooses the layout, so a file without `selected` is valid
        # (gpud.layout.parse.parse_layout's `label_selects`)
        self.label_selects = label_selects
        # the one resolution of (layout in force, observation): a load's own is reused, not redone
        self._resolved: tuple[ParsedLayout, Observation, Resolution] | None = None
        # (layout, observation, its resolution before the judge) worked out in a reading thread
        # resolutions made in reading threads, newest last: several GPUs' re-reads prepare theirs at
        # once (each step's GPU is read again in its own thread), so one slot lost all but the last
        self._ahead: collections.deque[tuple[ParsedLayout, Observation, Resolution]] = collections.deque(maxlen=AHEAD_KEPT)

    async def choose_async(self, name: str | None, observe: AsyncObserve | None = None) -> bool:
        """Put layout `name` of the file in force instead of the file's `selected` (None: the
        file's own choice again), checked against this host like any load; False when refused.
        The read, parse and resolve run off the event loop (see `load_async`)."""
        self.select = name
        return await self.load_async(observe)

    def layout_names(self) -> list[str]:
        """The layouts the file in force offers."""
        return list(self.layout.layout.layouts) if self.layout is not None and self.layout.layout is not None else []

    # ---- the daemon's file --------------------------------------------------------------------
    def load(self) -> bool:
        """Read and parse the file, on the caller's thread; a bad file never replaces the last good layout."""
        try:
            source = read_layout(self.path)
        except LayoutUnreadable as e:
            return self._unreadable(e)
        parsed, resolution, obs = self.evaluate(source.text, self.path, select=self.select)
        return self._take(parsed, resolution, source, obs)

    async def load_async(self, observe: AsyncObserve | None = None) -> bool:
        """`load` with the read, parse and resolve in a worker thread and the host read by
        `observe` (off the event loop too: a reload must not stall every client).

        Loads of the file never queue behind `check`/`plan` texts (their own slot), and callers
        share loads: one that arrives while no load has begun reading joins the next one, so
        applies that arrive together read the file once; a load already reading when a caller
        arrived may have read an older file, so that caller waits for the next."""
        fut = self._next_load
        if fut is None:
            fut = self._next_load = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(self._run_load(fut, observe))
            self._load_tasks.add(task)
            task.add_done_callback(self._load_tasks.discard)
        return await asyncio.shield(fut)  # a caller that gives up does not cancel the others' load

    async def _run_load(self, fut: asyncio.Future, observe: AsyncObserve | None) -> None:
        try:
            if self._file_slot is None:
                self._file_slot = asyncio.Semaphore(1)
            async with self._file_slot:
                if self._next_load is fut:
                    self._next_load = None  # reading starts now: a newcomer needs the next load
                try:
                    source = await asyncio.to_thread(read_layout, self.path)
                except LayoutUnreadable as e:
                    result = self._unreadable(e)
                else:
                    parsed, resolution, obs = await self._evaluate_off_loop(source.text, self.path, observe,
                                                                            self.select)
                    result = self._take(parsed, resolution, source, obs)
        except BaseException as e:  # noqa: BLE001 - handed to every caller that shares this load
            if self._next_load is fut:
                self._next_load = None
            if not fut.done():
                fut.set_exception(e)
            return
        if not fut.done():
            fut.set_result(result)

    def _unreadable(self, e: LayoutUnreadable) -> bool:
        self.issues = ([f"{e.message}; keeping the last good layout"], [])
        self.bus.publish("layout-invalid", self.issues[0][0])
        return False

    def _take(self, parsed: ParsedLayout, resolution: Resolution, source: LayoutSource, obs: Observation) -> bool:
        errors = [str(i) for i in resolution.errors]  # parse errors included: one full report
        warnings = [str(i) for i in resolution.warnings]
        if not source.quotable:
            errors = _unquoted(errors, [i.line for i in resolution.errors], "error", source.unquoted_because,
                               self.path)
            warnings = _unquoted(warnings, [i.line for i in resolution.warnings], "warning",
                                 source.unquoted_because, self.path)
        if errors:
            self.issues = (errors, warnings)
            self.bus.publish("layout-invalid", f"{len(resolution.errors)} error(s); keeping the last good layout",
                             errors=errors[:EVENT_ERRORS], errors_omitted=max(0, len(errors) - EVENT_ERRORS))
            return False
        # `apply` re-reads the file too: the same text again is not a new layout, and says nothing
        assert parsed.layout is not None  # a file that did not parse has errors
        if source.text != self._text or self.issues[0]:
            self.bus.publish("layout-loaded", f"{self.path}: selected {parsed.layout.selected!r}")
        refused = source.hooks_refused if has_hooks(parsed.layout.hooks) else ""
        if refused:
            warnings = [*warnings, f"{self.path}: hooks refused, no apply runs while they are named: {refused}"]
            if refused != self.hooks_refused or source.text != self._text:
                self.bus.publish("hooks-refused", f"{self.path}: hooks refused: {refused}")
        self.layout, self._text, self.hooks_refused = parsed, source.text, refused
        self._resolved = (parsed, obs, resolution)
        self.issues = ([], warnings)
        return True

    def resolve(self, obs: Observation) -> Resolution | None:
        """The layout in force resolved against `obs` (None before a good layout): computed once
        per (layout, observation) pair, the load's own resolution included."""
        if self.layout is None:
            return None
        done = self._resolved
        if done is not None and done[0] is self.layout and done[1] is obs:
            return done[2]
        ahead = next((r for parsed, seen, r in list(self._ahead) if parsed is self.layout and seen is obs), None)
        resolution = ahead if ahead is not None else resolve(self.layout, obs.gpus, gone=obs.gone,
                                                               index_problem=obs.index_problem)
        layout = self.layout.layout
        if self.judge is not None and layout is not None and layout.policy.on_infeasible == "skip-gpu":
            # judged as the load judged it: its infeasible GPUs stay warnings on every later read
            # of the host (the file in force is never refused here: under the default rule an
            # infeasibility found after the load fails only that GPU, in its state)
            resolution = self.judge(self.layout, resolution, obs)
        self._resolved = (self.layout, obs, resolution)
        return resolution

    def resolve_ahead(self, obs: Observation) -> Resolution | None:
        """In the thread that read `obs`: the layout in force resolved against it (pure work, about
        a millisecond at 64 GPUs), kept for `resolve`, which takes it on the loop when the layout
        is still the one it was made for and adds the judge's part there."""
        parsed = self.layout
        if parsed is None:
            return None
        resolution = resolve(parsed, obs.gpus, gone=obs.gone, index_problem=obs.index_problem)
        self._ahead.append((parsed, obs, resolution))  # deque.append: atomic across threads
        return resolution

    # ---- any text (check, plan) ---------------------------------------------------------------
    def evaluate(self, text: str, path: str, *, select: str | None = None,
                 ) -> tuple[ParsedLayout, Resolution, Observation]:
        """Parse a layout text and resolve it against this host as that layout's own `match:` sees
        it: selectors and profile names are checked against the real GPUs before the file is taken.
        `select` chooses a layout over the file's `selected`."""
        parsed = self._parse(text, path, select)
        obs = self.observe(self._match_of(parsed))
        return parsed, self._judged(parsed, resolve(parsed, obs.gpus, gone=obs.gone, index_problem=obs.index_problem),
                                    obs), obs

    async def evaluate_async(self, text: str, path: str, observe: AsyncObserve | None = None, *,
                             select: str | None = None) -> tuple[ParsedLayout, Resolution, Observation]:
        """`evaluate` with parse and resolve in a worker thread, one text at a time (five large
        `check` requests queue instead of multiplying the daemon's memory), and the host read by
        `observe`, awaited: the loop stays free."""
        async with self._slot():
            return await self._evaluate_off_loop(text, path, observe, select)

    async def _evaluate_off_loop(self, text: str, path: str, observe: AsyncObserve | None,
                                 select: str | None = None) -> tuple[ParsedLayout, Resolution, Observation]:
        parsed = await asyncio.to_thread(self._parse, text, path, select)
        match = self._match_of(parsed)
        # without an async reader (tests, tools) the keeper's own `observe` reads on the loop
        obs = await observe(match) if observe is not None else self.observe(match)
        def resolved() -> Resolution:
            resolution = resolve(parsed, obs.gpus, gone=obs.gone, index_problem=obs.index_problem)
            if self.prepare is not None:
                self.prepare(resolution, obs)
            return resolution

        resolution = await asyncio.to_thread(resolved)
        return parsed, self._judged(parsed, resolution, obs), obs

    def _judged(self, parsed: ParsedLayout, resolution: Resolution, obs: Observation) -> Resolution:
        return self.judge(parsed, resolution, obs) if self.judge is not None else resolution

    async def evaluate_each_async(self, text: str, path: str, names: list[str], observe: AsyncObserve | None = None,
                                  ) -> list[tuple[str, Resolution]]:
        """Each of the layouts `names` of one text, judged as `evaluate(select=name)` would judge it,
        from one parse and one read of the host: choosing a layout changes only `selected` (the
        parse with a caller's choice is the same for every name the file has), and the match,
        hence the GPUs read, is the file's whatever is selected. The loop serves others between
        layouts, and past a second the event stream says how far the check is."""
        if not names:
            return []
        async with self._slot():
            parsed, _, obs = await self._evaluate_off_loop(text, path, observe, names[0])

            def resolve_each() -> list[tuple[str, ParsedLayout, Resolution]]:
                out = []
                for name in names:
                    chosen = _with_selected(parsed, name)
                    out.append((name, chosen, resolve(chosen, obs.gpus, gone=obs.gone, index_problem=obs.index_problem)))
                return out

            judged = []
            said = time.monotonic()
            for k, (name, chosen, resolution) in enumerate(await asyncio.to_thread(resolve_each), 1):
                judged.append((name, self._judged(chosen, resolution, obs)))
                if time.monotonic() - said >= 1.0:
                    said = time.monotonic()
                    self.bus.publish("check", f"{path}: {k} of {len(names)} more layouts checked")
                await asyncio.sleep(0)
            return judged

    def _parse(self, text: str, path: str, select: str | None = None) -> ParsedLayout:
        too_large = check_text_size(text, path)
        if too_large is not None:  # refused before YAML sees it: the same bound as the file's
            return ParsedLayout(file=path, layout=None, errors=[LayoutIssue(path, None, "", too_large.split(": ", 1)[1])])
        return parse_layout(text, path, select=select, label_selects=self.label_selects)

    @staticmethod
    def _match_of(parsed: ParsedLayout) -> tuple[MatchRule, ...]:
        candidate = parsed.layout or parsed.draft
        return candidate.match if candidate is not None and candidate.match else DEFAULT_MATCH

    def _slot(self) -> asyncio.Semaphore:
        if self._parsing is None:
            self._parsing = asyncio.Semaphore(1)
        return self._parsing

    @property
    def match(self) -> tuple[MatchRule, ...]:
        """Which PCI functions the layout in force manages (gpud's default before there is one)."""
        if self.layout is not None and self.layout.layout is not None and self.layout.layout.match:
            return self.layout.layout.match
        return DEFAULT_MATCH


def _with_selected(parsed: ParsedLayout, name: str) -> ParsedLayout:
    """`parsed` (read with a caller's choice of a layout the file has) with `name` chosen instead."""
    layout = msgspec.structs.replace(parsed.layout, selected=name) if parsed.layout is not None else None
    draft = msgspec.structs.replace(parsed.draft, selected=name) if parsed.draft is not None else None
    return msgspec.structs.replace(parsed, layout=layout, draft=draft)


def has_hooks(hooks: Hooks) -> bool:
    return any(hooks.for_phase(phase) for phase in HOOK_PHASES)
