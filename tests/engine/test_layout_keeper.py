"""The daemon's layout file as the engine takes it: unreadable or oversized files are errors
(never `valid`), and the text of a file that group gpud must not read is never quoted."""

from __future__ import annotations

import os

from gpud.engine.events import EventBus
from gpud.engine.layout_keeper import LayoutKeeper
from gpud.engine.observe.discovery import Observation
from gpud.host.files.layout_source import MAX_LAYOUT_BYTES
from tests.support.present import present

NO_GPUS = Observation(gpus=(), functions=())
SECRET = "root:$6$Zq9SeCrEtHaSh$abcdefghijkl:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n"


def keeper(path) -> tuple[LayoutKeeper, EventBus]:
    bus = EventBus()
    return LayoutKeeper(str(path), bus, lambda match: NO_GPUS), bus


def everything_shown(k: LayoutKeeper, bus: EventBus) -> str:
    """Every text a member of group gpud can read about the file: status errors and events."""
    return repr(k.issues) + repr(bus.recent())


def test_symlink_to_a_secret_in_another_tree_is_not_quoted(tmp_path):
    secret = tmp_path / "root" / "shadow"
    secret.parent.mkdir()
    secret.write_text(SECRET)
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "layout.yaml").symlink_to(secret)
    k, bus = keeper(etc / "layout.yaml")
    assert not k.load()
    shown = everything_shown(k, bus)
    for word in ("SeCrEtHaSh", "abcdefghijkl", "daemon", "19000", "99999", "$6$"):
        assert word not in shown, (word, shown)
    assert "not quoted because" in k.issues[0][0] and "at line(s) 1" in k.issues[0][0]


def test_file_owned_by_another_user_is_not_quoted(tmp_path):
    path = tmp_path / "layout.yaml"
    path.write_text("version: v1\nsecret-token: abc123XYZ\nlayouts: {a: []}\n")
    os.chown(path, os.geteuid() + 1000, -1)
    k, bus = keeper(path)
    assert not k.load()
    assert "abc123XYZ" not in everything_shown(k, bus) and "secret-token" not in everything_shown(k, bus)


def test_gpuds_own_file_is_quoted_as_before(tmp_path):
    path = tmp_path / "layout.yaml"
    path.write_text("version: v1\nsecret-token: abc123XYZ\nlayouts: {a: []}\n")
    k, _ = keeper(path)
    assert not k.load()
    assert k.issues[0] == [f'{path}:2 secret-token: unknown key "secret-token"; allowed: version, selected, '
                           f"layouts, mig-configs, vgpu-configs, match, policy, hooks"]


def test_unreadable_files_are_errors_and_never_valid(tmp_path):
    good = "version: v1\nlayouts: {a: []}\n"
    path = tmp_path / "layout.yaml"
    path.write_text(good)
    k, _ = keeper(path)
    assert k.load() and k.issues == ([], [])
    path.unlink()
    path.symlink_to("/dev/zero")
    assert not k.load()
    assert k.issues[0] == [f"{path}: a character device, not a regular file; the layout must be a regular file; "
                           f"keeping the last good layout"]
    path.unlink()
    with open(path, "wb") as f:
        f.truncate(MAX_LAYOUT_BYTES + 1)
    assert not k.load()
    assert f"a layout may be at most {MAX_LAYOUT_BYTES} bytes (512 KiB)" in k.issues[0][0]
    assert k.layout is not None  # the last good layout stays in force


async def test_oversized_check_text_is_refused_before_parsing(tmp_path):
    k, _ = keeper(tmp_path / "layout.yaml")
    text = "version: v1\nlayouts: {a: []}\n" + "#" * MAX_LAYOUT_BYTES
    parsed, resolution, _ = await k.evaluate_async(text, "big.yaml")
    assert [str(e) for e in resolution.errors] == [
        f"big.yaml: the layout is {len(text)} bytes; a layout may be at most {MAX_LAYOUT_BYTES} bytes (512 KiB)"]


def test_layout_invalid_event_carries_a_bounded_error_list(tmp_path):
    path = tmp_path / "layout.yaml"
    path.write_text("version: v1\nlayouts:\n  a:\n    - devices: [" + ", ".join(map(str, range(500))) + "]\n")
    k, bus = keeper(path)
    assert not k.load()
    assert len(k.issues[0]) == 500  # all of them kept: the API caps what a reply carries
    event = bus.recent()[-1]
    assert event["kind"] == "layout-invalid"
    assert len(event["data"]["errors"]) == 20 and event["data"]["errors_omitted"] == 480


TWO_LAYOUTS = "version: v1\nselected: first\nlayouts:\n  first: []\n  second: []\n"


async def test_a_chosen_layout_stays_in_force_across_reloads(tmp_path):
    """A node label's choice (LayoutKeeper.choose_async, as the daemon makes it) outranks the
    file's `selected` on every load; choosing None gives the file its own choice back."""
    path = tmp_path / "layout.yaml"
    path.write_text(TWO_LAYOUTS)
    k, _ = keeper(path)
    assert await k.load_async() and present(k.layout).selected == "first"
    assert await k.choose_async("second") and present(k.layout).selected == "second"
    assert await k.load_async() and present(k.layout).selected == "second"  # a file re-read keeps the label's choice
    assert await k.choose_async(None) and present(k.layout).selected == "first"


async def test_evaluating_a_text_honours_its_own_choice_and_leaves_the_one_in_force(tmp_path):
    path = tmp_path / "layout.yaml"
    path.write_text(TWO_LAYOUTS)
    k, _ = keeper(path)
    assert await k.choose_async("second") and present(k.layout).selected == "second"
    _, resolution, _ = await k.evaluate_async(TWO_LAYOUTS, str(path), select="second")
    assert resolution.selected == "second" and not resolution.errors
    _, refused, _ = await k.evaluate_async(TWO_LAYOUTS, str(path), select="third")
    assert refused.errors  # a name the file does not offer is an error, as for `selected`
    assert present(k.layout).selected == "second"  # evaluating another text changes nothing
