"""Framing and message types of the gpud socket protocol."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys

import msgspec
import pytest

from gpud.wire import protocol as wire
from gpud.wire import replies as wire_replies
from gpud.wire import tables as wire_tables
from tests.api.fakes import plan_reply, status_reply
from tests.support.present import present


def test_frame_is_big_endian_length_and_a_plain_msgpack_map():
    frame = wire.encode_frame(wire.Request(id=7, op="check", args={"text": "x", "path": "/l.yaml"}))
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    # any MessagePack implementation can read it: a map with these keys, no extension types
    assert msgspec.msgpack.decode(frame[4:]) == {"id": 7, "op": "check", "args": {"text": "x", "path": "/l.yaml"}}


def test_request_round_trip_and_default_args():
    payload = msgspec.msgpack.encode({"id": 1, "op": "status"})
    assert wire.decode_request(payload) == wire.Request(id=1, op="status", args={})


@pytest.mark.parametrize("payload, rid", [
    (b"\xc1", 0),  # never-used MessagePack byte
    (msgspec.msgpack.encode([1, "status", {}]), 0),  # an array, not a map
    (msgspec.msgpack.encode({"id": 9, "args": {}}), 9),  # no op: the id is still answered
    (msgspec.msgpack.encode({"id": "9", "op": "status"}), 0),
])
def test_malformed_requests_raise_with_best_effort_id(payload, rid):
    with pytest.raises(wire.FrameError) as e:
        wire.decode_request(payload)
    assert e.value.request_id == rid
    assert e.value.code == wire.E_BAD_FRAME


def test_encode_refuses_frames_the_peer_would_reject():
    with pytest.raises(wire.FrameTooLarge):
        wire.encode_frame({"blob": "x" * 2000}, max_frame=1024)


def test_decode_message_tells_events_from_responses():
    ev = wire.EventFrame(id=3, event=wire.Event(time=1.5, kind="step", gpu="0000:3b:00.0", message="m"))
    resp = wire.Response(id=3, ok=False, error=wire.ErrorInfo(code="forbidden", message="no"))
    assert wire.decode_message(wire.encode_frame(ev)[4:]) == ev
    assert wire.decode_message(wire.encode_frame(resp)[4:]) == resp


def test_results_are_typed_by_op_and_tolerate_unknown_and_missing_fields():
    raw = msgspec.to_builtins(status_reply())
    raw["gpus"][0]["added_in_a_later_version"] = 1
    del raw["gpus"][0]["vfio_device"]
    typed = wire_replies.decode_result("status", raw)
    assert isinstance(typed, wire_replies.StatusReply)
    assert typed.gpus[0].vfio_device is None
    assert typed.gpus[0].mig.instances[0].placement == wire_replies.Placement(start=4, size=1)
    with pytest.raises(wire.FrameError):
        wire_replies.decode_result("status", {"layout": {}})


LEASE = wire_replies.LeaseInfo(id="l-1", gpu="0000:3b:00.0", index=0, profile="1g.10gb", placement="0:1",
                               uuid="MIG-x", devices=["/dev/nvidia0"], owner="job", pid=7, created=1.5)


def test_every_result_struct_is_json_able_with_a_stable_shape():
    samples = {
        "status": status_reply(), "plan": plan_reply(), "check": wire_replies.CheckReply(valid=False, errors=["e"]),
        "apply": wire_replies.ApplyReply(phase="failed"), "reload": wire_replies.LayoutStatus(path="/l"),
        "select": wire_replies.LayoutStatus(path="/l", selected="a", chosen=True),
        "events": wire_replies.EventsReply(events=[wire.Event(time=0.0, kind="k")]),
        "version": wire_replies.VersionReply(version="0.1.0"), "mig-profiles": wire_tables.MigProfilesReply(),
        "mig-compute-profiles": wire_tables.MigComputeProfilesReply(gpus=[wire_tables.GpuComputeProfiles(
            index=0, pci="p", instances=[wire_tables.GiComputeProfiles(
                gi=1, profile="3g.40gb", placement=wire_replies.Placement(start=0, size=4), profiles=[
                    wire_tables.ComputeProfileInfo(id=0, name="1c.3g.40gb", slices=1, free=1, total=3, sms=16)])])]),
        "passthrough": wire_tables.PassthroughReply(devices=[wire_tables.PassthroughDevice(pci="p", vendor_device="10de:2335")],
                                                     vgpus=[wire_tables.VgpuPassthrough(gpu="p", type="L40S-12Q", vf="v")]),
        "stats": wire_replies.StatsReply(window_s=1.5, loop_lag=wire_replies.LoopLag(samples=3, p99_ms=2.5), requests={"status": 2}),
        "labels": wire_replies.LabelsReply(path="/f", result="written", file={"nvidia.com/gpu.count": "8"},
                                           labels={"nvidia.com/gpu.count": "8"}),
        "vgpu-types": wire_tables.VgpuTypesReply(gpus=[wire_tables.GpuVgpuTypes(index=0, pci="p", types=[
            wire_tables.VgpuTypeInfo(name="H200X-1-18C", id=1414, mig_profile="1g.18gb", creatable=7, max=7)])]),
        "lease": LEASE,
        "release": wire_replies.ReleaseReply(lease=LEASE, message="lease l-1 released"),
        "leases": wire_replies.LeasesReply(leases=[LEASE]),
    }
    assert set(samples) == set(wire_replies.RESULTS)
    for op, obj in samples.items():
        doc = json.loads(msgspec.json.encode(obj))
        assert wire_replies.decode_result(op, doc) == obj
    gpu = json.loads(msgspec.json.encode(status_reply()))["gpus"][0]
    assert gpu["group"][0]["class"] == "0x030200"  # `class` on the wire, `class_` in Python
    assert gpu["vfio_device"] is None  # defaults are not omitted: `--json` consumers see every key


def test_default_structs_are_not_shared_between_instances():
    a, b = wire_replies.GpuStatus(index=0, pci="a"), wire_replies.GpuStatus(index=1, pci="b")
    a.mig.instances.append(wire_replies.InstanceStatus(profile="1g.18gb", placement=wire_replies.Placement(start=0, size=1),
                                                       gi=1, ci=0, uuid="MIG-x"))
    assert b.mig.instances == []


@pytest.mark.parametrize("op, args, ok", [
    ("check", {"text": "t", "path": "/p"}, True),
    ("check", {"text": "t"}, False),
    ("apply", {"wait": True, "timeout": 3}, True),
    ("apply", {"wait": True, "timeout": float("nan")}, False),  # issue 33 item 11: answered `timeout` at once
    ("apply", {"wait": True, "timeout": float("inf")}, False),
    ("apply", {"wait": True, "timeout": -1.0}, False),
    ("apply", {"wait": True, "timeout": 0}, True),  # answer now
    ("apply", {"wait": "yes"}, False),
    ("apply", {"wiat": True}, False),  # typos are refused, not ignored
    ("events", {}, True),
    ("mig-profiles", {"gpu": "0000:3b:00.0"}, True),
    ("status", {"x": 1}, False),
    ("check", {"text": "t", "path": "/p", "all_layouts": True}, True),
    ("labels", {}, True),
])
def test_args_validation(op, args, ok):
    if ok:
        msgspec.convert(args, wire.ARGS[op])
    else:
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(args, wire.ARGS[op])


def test_sync_reader_reads_frames_then_clean_eof():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(wire.encode_frame({"n": 1}) + wire.encode_frame({"n": 2}) + wire.HEADER.pack(0))
        a.shutdown(socket.SHUT_WR)
        r = wire.FrameReader()
        assert msgspec.msgpack.decode(present(r.read_sync(b))) == {"n": 1}
        assert msgspec.msgpack.decode(present(r.read_sync(b))) == {"n": 2}
        assert r.read_sync(b) == b""
        assert r.read_sync(b) is None


def test_sync_reader_rejects_truncated_and_oversized_frames():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(wire.HEADER.pack(10) + b"abc")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(wire.FrameError, match="inside a frame"):
            wire.FrameReader().read_sync(b)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(wire.HEADER.pack(2048) + b"body")
        with pytest.raises(wire.FrameTooLarge):
            wire.FrameReader(max_frame=1024).read_sync(b)
        b.setblocking(False)
        assert b.recv(16) == b"body"  # the oversized body was not read


async def test_async_reader():
    reader = asyncio.StreamReader()
    reader.feed_data(wire.encode_frame({"n": 1}) + wire.HEADER.pack(5) + b"ab")
    reader.feed_eof()
    r = wire.FrameReader()
    assert msgspec.msgpack.decode(present(await r.read_async(reader))) == {"n": 1}
    with pytest.raises(wire.FrameError):
        await r.read_async(reader)
    empty = asyncio.StreamReader()
    empty.feed_eof()
    assert await r.read_async(empty) is None
    half = asyncio.StreamReader()
    half.feed_data(b"\x00\x00")
    half.feed_eof()
    with pytest.raises(wire.FrameError, match="header"):
        await r.read_async(half)
    big = asyncio.StreamReader()
    big.feed_data(wire.HEADER.pack(wire.MAX_FRAME + 1))
    with pytest.raises(wire.FrameTooLarge):
        await r.read_async(big)


def test_the_protocol_modules_import_only_stdlib_and_msgspec():
    # what msgspec itself pulls in (typing_extensions) is msgspec's business, not ours
    code = (
        "import sys, msgspec; before = set(sys.modules); import gpud.wire.protocol, gpud.wire.replies; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "print(' '.join(sorted(new - set(sys.stdlib_module_names))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert set(out) <= {"gpud"}, out


def test_kubernetes_status_round_trips():
    k = wire_replies.KubernetesStatus(
        advertised=wire_replies.Advertised(resources={"nvidia.com/gpu": 7, "nvidia.com/mig-1g.10gb": 4},
                                           sandbox={"nvidia.com/GH100_H100_SXM5_80GB": 1}, problems=["p"]),
        agent=wire_replies.KubeAgentStatus(node="n", connected=True, selected="partial-mig", state="success",
                                           paused=["nvidia.com/gpu.deploy.dcgm"]))
    doc = json.loads(msgspec.json.encode(k))
    assert doc["advertised"]["resources"] == {"nvidia.com/gpu": 7, "nvidia.com/mig-1g.10gb": 4}
    assert msgspec.convert(doc, wire_replies.KubernetesStatus) == k
