"""The NFD feature directory as a hostile local user who can write it would use it: a FIFO or a
link at gpud's path. Neither blocks the daemon's reads, and `gpudctl labels` (a read op of the
gpud group) never shows what a link points at."""

from __future__ import annotations

import os
import threading

import pytest

from gpud.api import replies
from gpud.cli.render import render_labels
from gpud.engine.kube.node_labels_out import LabelsOut
from gpud.host.kube import nfd
from tests.support.present import present

LABELS = {"nvidia.com/gpu.count": "8", "nvidia.com/gpud.layout.state": "success"}


def _in_thread(fn, fifo=None):
    """fn() in a thread that must end within 10 s; returns its result or exception."""
    out: list = []

    def run():
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - the outcome is checked by the caller
            out.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=10)
    if t.is_alive():
        if fifo is not None:  # let the stuck open() return so the thread can end
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        pytest.fail("blocked on the FIFO")
    return out[0]


def test_a_fifo_at_the_features_path_blocks_neither_labels_nor_the_write(tmp_path):
    d = tmp_path / "features.d"
    d.mkdir()
    fifo = d / "gpud"
    os.mkfifo(fifo)
    got = _in_thread(lambda: nfd.read_features(str(fifo)), fifo)
    assert isinstance(got, nfd.FeaturesRefused) and "a FIFO" in str(got)
    assert _in_thread(lambda: nfd.write_features(str(fifo), LABELS), fifo) == "written"
    assert nfd.read_features(str(fifo)) == LABELS  # the FIFO was replaced by gpud's file


def test_labels_never_show_a_linked_root_only_file(tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$secrethash:19000:0:99999:7:::\n")
    secret.chmod(0o600)
    d = tmp_path / "features.d"
    d.mkdir()
    (d / "gpud").symlink_to(secret)
    out = LabelsOut(str(d / "gpud"))
    reply = replies.labels_reply(out)
    text = render_labels(reply)
    assert reply.file is None and "symbolic link" in (reply.file_refused or "")
    assert "secrethash" not in text and "root:" not in text
    assert "not shown" in text


def test_labels_never_show_a_file_gpud_did_not_write(tmp_path):
    d = tmp_path / "features.d"
    d.mkdir()
    (d / "gpud").write_text("planted=1\n")
    os.chown(d / "gpud", 65534, 65534)
    reply = replies.labels_reply(LabelsOut(str(d / "gpud")))
    assert reply.file is None and "uid 65534" in present(reply.file_refused)


def test_the_pass_replaces_a_link_at_the_path_without_writing_through_it(tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text("root:x\n")
    d = tmp_path / "features.d"
    d.mkdir()
    (d / "gpud").symlink_to(secret)
    assert nfd.write_features(str(d / "gpud"), LABELS) == "written"
    assert secret.read_text() == "root:x\n" and not (d / "gpud").is_symlink()
    assert nfd.read_features(str(d / "gpud")) == LABELS


def test_a_world_writable_features_directory_is_refused_with_the_reason(tmp_path):
    d = tmp_path / "features.d"
    d.mkdir()
    d.chmod(0o777)
    events = []
    out = LabelsOut(str(d / "gpud"), on_event=lambda kind, m: events.append(m))
    from gpud.plan.node_labels import LabelInputs
    out.write(LabelInputs(gpus=(), driver_version=None, cuda_driver_version=None, compute={}, workloads={},
                          layout=None, state="success", mig_strategy="mixed"))
    assert present(out.last_result).startswith("error: ") and "not sticky" in present(out.last_result)
    assert any("not sticky" in m for m in events)
    assert os.listdir(d) == []
