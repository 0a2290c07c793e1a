"""Writing and reading as root where a user may aim the path: safe_file against the attacks a
hostile local user has (links at the target and at the temp name, a FIFO, a world-writable
directory, a hard link to a root-only file). Each test checks the victim file's bytes, not the
code's word."""

from __future__ import annotations

import errno
import os
import socket
import stat
import threading

import pytest

from gpud.host.files import safe_file

NOBODY = 65534


def _victim(tmp_path):
    secret = tmp_path / "root-only" / "shadow"
    secret.parent.mkdir()
    secret.write_bytes(b"root:secret-hash:19000:0:99999:7:::\n")
    secret.chmod(0o600)
    return secret


def test_write_replaces_the_file_durably(tmp_path):
    target = tmp_path / "gpud.prom"
    target.write_bytes(b"old\n")
    safe_file.write_file(str(target), b"new\n", mode=0o640)
    assert target.read_bytes() == b"new\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["gpud.prom"]  # no temp file left


def test_a_link_at_the_target_is_replaced_never_followed(tmp_path):
    secret = _victim(tmp_path)
    d = tmp_path / "out"
    d.mkdir()
    (d / "gpud.prom").symlink_to(secret)
    safe_file.write_file(str(d / "gpud.prom"), b"metrics\n")
    assert secret.read_bytes().startswith(b"root:secret-hash")
    assert not (d / "gpud.prom").is_symlink()
    assert (d / "gpud.prom").read_bytes() == b"metrics\n"


def test_a_link_planted_at_the_temp_name_is_never_followed(tmp_path):
    """The temp name is random; were a user to guess it, the O_EXCL|O_NOFOLLOW create fails."""
    secret = _victim(tmp_path)
    d = tmp_path / "out"
    d.mkdir()
    (d / ".gpud.prom.guessed").symlink_to(secret)
    with pytest.raises(FileExistsError):
        safe_file.write_file(str(d / "gpud.prom"), b"metrics\n", _name=lambda name: f".{name}.guessed")
    assert secret.read_bytes().startswith(b"root:secret-hash")
    assert (d / ".gpud.prom.guessed").is_symlink()  # the user's link is left alone, not removed as ours
    assert not (d / "gpud.prom").exists()


def test_temp_names_are_unpredictable():
    names = {safe_file.temp_name("gpud.prom") for _ in range(100)}
    assert len(names) == 100 and all(n.startswith(".gpud.prom.gpud-") for n in names)


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_directory_others_may_write_is_refused_unless_sticky(tmp_path, mode):
    d = tmp_path / "textfiles"
    d.mkdir()
    d.chmod(mode)
    with pytest.raises(safe_file.UnsafeDirectory) as e:
        safe_file.write_file(str(d / "gpud.prom"), b"x\n")
    assert "not sticky" in str(e.value) and str(d) in str(e.value)
    assert os.listdir(d) == []
    d.chmod(mode | stat.S_ISVTX)
    safe_file.write_file(str(d / "gpud.prom"), b"x\n")
    assert (d / "gpud.prom").read_bytes() == b"x\n"


def test_a_directory_owned_by_another_user_is_refused(tmp_path):
    d = tmp_path / "node-exporter"
    d.mkdir(mode=0o755)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(safe_file.UnsafeDirectory, match="its owner"):
        safe_file.write_file(str(d / "gpud.prom"), b"x\n")


def test_sticky_directory_with_someone_elses_file_at_the_name_is_refused(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o1777)
    (d / "gpud").write_bytes(b"theirs\n")
    os.chown(d / "gpud", NOBODY, NOBODY)
    with pytest.raises(safe_file.UnsafeDirectory, match=f"belongs to uid {NOBODY}"):
        safe_file.write_file(str(d / "gpud"), b"ours\n")
    assert (d / "gpud").read_bytes() == b"theirs\n"


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "vgpu-record.json"
    target.write_bytes(b"{}\n")

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(safe_file, "write_all", full)
    with pytest.raises(OSError) as e:
        safe_file.write_file(str(target), b'{"a": 1}\n')
    assert e.value.errno == errno.ENOSPC
    assert target.read_bytes() == b"{}\n"
    assert os.listdir(tmp_path) == ["vgpu-record.json"]


def test_read_refuses_a_link(tmp_path):
    secret = _victim(tmp_path)
    (tmp_path / "gpud").symlink_to(secret)
    with pytest.raises(safe_file.UnsafeFile, match="symbolic link"):
        safe_file.read_file(str(tmp_path / "gpud"), 65536)


def _unblock(fifo):
    """Release a reader stuck in open() on `fifo` (only a broken reader would be)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    except OSError:
        pass


def test_read_of_a_fifo_returns_at_once(tmp_path):
    fifo = tmp_path / "gpud"
    os.mkfifo(fifo)
    result: list = []

    def read():
        try:
            safe_file.read_file(str(fifo), 65536)
        except Exception as e:  # noqa: BLE001 - the outcome is checked below
            result.append(e)
    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout=10)
    if t.is_alive():
        _unblock(fifo)
        pytest.fail("reading a FIFO blocked")
    assert isinstance(result[0], safe_file.UnsafeFile) and "a FIFO" in str(result[0])


@pytest.mark.parametrize("what", ["directory", "socket"])
def test_read_refuses_other_kinds(tmp_path, what):
    p = tmp_path / "gpud"
    if what == "directory":
        p.mkdir()
    else:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(p))
    with pytest.raises(safe_file.UnsafeFile, match=f"a {what}"):
        safe_file.read_file(str(p), 65536)


def test_read_is_bounded(tmp_path):
    p = tmp_path / "gpu-index.json"
    p.write_bytes(b"x" * 1001)
    with pytest.raises(safe_file.UnsafeFile, match="1001 bytes"):
        safe_file.read_file(str(p), 1000)
    assert safe_file.read_file(str(p), 1001) == b"x" * 1001


def test_owned_refuses_a_stranger_file_and_a_hard_link(tmp_path):
    theirs = tmp_path / "gpud"
    theirs.write_bytes(b"a=b\n")
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(safe_file.UnsafeFile, match=f"uid {NOBODY}"):
        safe_file.read_file(str(theirs), 100, owned=True)
    theirs.unlink()
    secret = _victim(tmp_path)
    os.link(secret, theirs)
    with pytest.raises(safe_file.UnsafeFile, match="2 hard links"):
        safe_file.read_file(str(theirs), 100, owned=True)


def test_set_aside_renames_without_following(tmp_path):
    secret = _victim(tmp_path)
    p = tmp_path / "boot.json"
    p.symlink_to(secret)
    aside = safe_file.set_aside(str(p))
    assert aside is not None and os.path.islink(aside) and not p.exists()
    assert secret.read_bytes().startswith(b"root:secret-hash")
    assert safe_file.set_aside(str(p)) is None
