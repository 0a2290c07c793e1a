"""Durable whole-file replacement (host/files/safe_file.py write_file)."""

from __future__ import annotations

import os

from gpud.host.files import safe_file


def test_short_writes_are_completed(tmp_path, monkeypatch):
    """os.write may return fewer bytes than asked; the file renamed in must still be whole."""
    real_write = os.write
    calls = []

    def short_write(fd, data):
        calls.append(len(data))
        return real_write(fd, bytes(data[:3]))

    monkeypatch.setattr(safe_file.os, "write", short_write)
    path = tmp_path / "rules"
    payload = b"ACTION==\"add\", KERNEL==\"0000:3b:00.0\"\n" * 5
    safe_file.write_file(str(path), payload, mode=0o600)
    assert path.read_bytes() == payload
    assert len(calls) > 1
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


def test_failed_write_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "rules"
    path.write_bytes(b"old\n")

    def failing_write(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safe_file.os, "write", failing_write)
    try:
        safe_file.write_file(str(path), b"new\n")
    except OSError as e:
        assert e.errno == 28
    else:
        raise AssertionError("the failed write was not reported")
    assert path.read_bytes() == b"old\n"
    assert os.listdir(tmp_path) == ["rules"]
