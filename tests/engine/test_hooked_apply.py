"""The hook phases a pass runs around the GPUs it changes, driven by the reconciler on a simulated
host. What the hooks were told is compared with the simulator's own state file: the GPUs whose MIG
state changed there are the ones the hooks were named, and a failing before-hook leaves that file's
GPUs exactly as they were."""

from __future__ import annotations

import stat

import msgspec
import pytest
import yaml

from gpud.sim import state as simstate
from tests.scenarios.definitions import layout, mig
from tests.support.simrig import SimRig

PHASES = ("apply-start", "pre-apply-mode", "pre-apply-config", "apply-exit")


@pytest.fixture
def rig(tmp_path):
    r = SimRig(tmp_path, ("a100-40gb:2",))
    yield r
    r.close()


def recorder(tmp_path, exit_code: int = 0) -> str:
    """A hook that appends what it was told to tmp_path/told, then exits with `exit_code`."""
    p = tmp_path / f"record-{exit_code}.sh"
    p.write_text('#!/bin/sh\necho "$GPUD_PHASE|$GPUD_GPUS|$GPUD_MODE_CHANGE|$GPUD_CHANGED_MIG|$GPUD_RESULT"'
                 f' >> {tmp_path}/told\nexit {exit_code}\n')
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return str(p)


def with_hooks(text: str, hooks: dict[str, str]) -> str:
    doc = yaml.safe_load(text)
    doc["hooks"] = {phase: [{"command": cmd}] for phase, cmd in hooks.items()}
    return yaml.safe_dump(doc, sort_keys=False)


def gpus_on_file(rig: SimRig) -> dict[str, bytes]:
    """Each simulated GPU's MIG mode and instances, as the simulator's state file holds them."""
    return {a: msgspec.json.encode((g.mig_mode, g.mig_pending, g.gis)) for a, g in simstate.load(rig.dir).gpus.items()}


def told(tmp_path) -> list[list[str]]:
    path = tmp_path / "told"
    return [line.split("|") for line in path.read_text().splitlines()] if path.exists() else []


async def test_phases_in_order_naming_the_gpus_that_changed(rig, tmp_path):
    cmd = recorder(tmp_path)
    before = gpus_on_file(rig)
    assert await rig.apply(with_hooks(layout(mig([0], {"3g.20gb": 2})), dict.fromkeys(PHASES, cmd)))
    after = gpus_on_file(rig)
    changed = sorted(a for a in before if before[a] != after[a])
    assert len(changed) == 1
    assert told(tmp_path) == [
        ["apply-start", changed[0], "1", "0", ""],
        ["pre-apply-mode", changed[0], "1", "0", ""],
        ["pre-apply-config", changed[0], "1", "0", ""],
        ["apply-exit", changed[0], "1", "1", "success"],
    ]
    # nothing left to change: no hook runs at all
    (tmp_path / "told").unlink()
    await rig.rec.converge()
    assert told(tmp_path) == [] and gpus_on_file(rig) == after


async def test_a_failing_before_hook_changes_nothing_and_apply_exit_still_runs(rig, tmp_path):
    before = gpus_on_file(rig)
    hooks = {"pre-apply-config": recorder(tmp_path, exit_code=3), "apply-exit": recorder(tmp_path)}
    assert await rig.apply(with_hooks(layout(mig("all", {"7g.40gb": 1})), hooks))
    assert gpus_on_file(rig) == before
    states = {pci: st for pci, st in rig.rec.gpu_states.items()}
    assert sorted(states) == sorted(before)
    for st in states.values():
        assert st.state == "failed" and "hook aborted the apply, nothing changed" in st.message
        assert "pre-apply-config hook" in st.message and "exited 3" in st.message
    phases = [(t[0], t[4]) for t in told(tmp_path)]
    assert phases == [("pre-apply-config", ""), ("apply-exit", "failure")]
    assert told(tmp_path)[0][1].split() == sorted(before)


async def test_a_layout_taken_while_the_pass_reads_the_host_brings_its_own_hooks(rig, tmp_path):
    """Issue 33 item 13: a layout written while the first pass was still reading the host had its
    MIG changes applied without its apply-start hook: the hooks came from the layout the pass
    started with, the steps from the one resolved. Here the new file is taken inside the pass's
    read, at the point where the race put it."""
    cmd = recorder(tmp_path)
    assert await rig.apply(layout(mig("all", None)))  # no hooks, nothing to change
    before = gpus_on_file(rig)
    new = with_hooks(layout(mig([0], {"3g.20gb": 2})), {"apply-start": cmd})
    rec, read = rig.rec, rig.rec.refresh_async
    taken: list[bool] = []

    async def read_then_edit(*a, **kw):
        got = await read(*a, **kw)
        if not taken:
            rig.config.write_text(new)
            taken.append(await rec.reload_async("layout changed"))
        return got

    rec.refresh_async = read_then_edit
    await rec.converge()
    assert taken == [True]
    after = gpus_on_file(rig)
    assert sorted(a for a in before if before[a] != after[a]), "the new layout's MIG change was applied"
    assert [t[0] for t in told(tmp_path)] == ["apply-start"]  # and its hook ran before it


@pytest.mark.parametrize("how", ["group-writable directory", "file of another user", "world-writable file"])
async def test_hooks_from_a_file_root_does_not_hold_alone_are_refused(rig, tmp_path, how):
    """Issue 33 item 2: gpud ran as root the hooks of a layout another user owned or could replace.
    Now such hooks are refused, said in status (the layout's warnings, the GPUs' states) and in
    events, and nothing is changed: an apply without the hooks it names could do harm."""
    import os

    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    cmd = recorder(tmp_path)
    before = gpus_on_file(rig)
    rig.config.write_text(with_hooks(layout(mig([0], {"3g.20gb": 2})), {"apply-start": cmd}))
    if how == "group-writable directory":
        rig.config.parent.chmod(0o775)
    elif how == "file of another user":
        os.chown(rig.config, 65534, -1)
    else:
        rig.config.chmod(0o666)
    assert rig.rec.load_config()
    await rig.rec.converge()
    assert gpus_on_file(rig) == before and told(tmp_path) == []  # nothing changed, the hook never ran
    view = rig.rec.view()
    assert any("hooks refused" in w for w in view.layout_warnings), view.layout_warnings
    assert {s.state for s in view.gpu_states.values()} >= {"failed"}
    assert any(e["kind"] == "hooks-refused" for e in rig.bus.recent())
    # the same text from a file only root may change: applied, its hook first
    rig.config.parent.chmod(0o755)
    os.chown(rig.config, 0, -1)
    rig.config.chmod(0o644)
    assert rig.rec.load_config()
    await rig.rec.converge()
    assert gpus_on_file(rig) != before and [t[0] for t in told(tmp_path)] == ["apply-start"]
