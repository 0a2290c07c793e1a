"""gpudctl reads replies as gpud sent them (msgpack's maps, through gpud.cli.view) instead of
decoding them into the wire structs with msgspec. The oracle here is msgspec's typed decode of the
same maps (gpud.wire.replies.decode_result, code the view shares nothing with): every command's
output, on the fake gpud's replies, on richer ones, on the replies a real gpud sent on the lent
H200 (recorded by an older gpud, so fields it lacks are filled), must be the same both ways; and the
rules that make a map read like its struct are held for every struct of the protocol."""

from __future__ import annotations

import json
import keyword
import time
import types
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpud.api import server
from gpud.cli import view
from gpud.wire import frames
from gpud.wire import protocol as wire
from gpud.wire import replies as wire_replies
from gpud.wire import tables as wire_tables
from tests.api.fakes import MIG_UUIDS, ThreadedServer
from tests.support.client_view import both_ways

REPO = Path(__file__).resolve().parents[2]
H200 = REPO / "tests" / "fixtures" / "h200-gpud-readonly"
P = wire_replies.Placement
H = wire_replies.HolderInfo


def _structs() -> list[type[msgspec.Struct]]:
    """Every struct a reply or an event can hold, found from RESULTS and Event through the field types."""
    seen: list[type[msgspec.Struct]] = []
    todo: list[Any] = [*wire_replies.RESULTS.values(), wire.Event]
    while todo:
        t = todo.pop()
        if isinstance(t, type) and issubclass(t, msgspec.Struct):
            if t not in seen:
                seen.append(t)
                todo += [f.type for f in msgspec.structs.fields(t)]
        else:
            todo += typing.get_args(t)
    return seen


def _leaf_types(t: Any) -> set[Any]:
    if isinstance(t, type) and issubclass(t, msgspec.Struct):
        return set()
    args = typing.get_args(t)
    origin = typing.get_origin(t)
    if origin in (list, dict, typing.Union, types.UnionType):
        return {origin} | {x for a in args for x in _leaf_types(a)}
    return {t}


def test_every_struct_reads_the_same_from_its_map():
    """What makes a decoded map read like its struct: every field on the wire (no omitted defaults,
    no tag, not an array), under its own name or, for a Python keyword, without the trailing
    underscore; no field named like a dict attribute; and only types msgpack decodes as msgspec does
    (a float field holds the number gpud wrote: an int where gpud wrote one, the same JSON number)."""
    structs = _structs()
    assert {wire_replies.StatusReply, wire_replies.GroupMember, wire_tables.ProfileInfo, wire.Event} <= set(structs)
    assert len(structs) > 40
    for s in structs:
        config = s.__struct_config__
        assert not config.omit_defaults and config.tag is None and not config.array_like, s
        for f in msgspec.structs.fields(s):
            assert f.encode_name == f.name or (f.name == f.encode_name + "_" and keyword.iskeyword(f.encode_name)), (s, f)
            assert not hasattr(dict, f.name) and not f.name.startswith("_"), (s, f)
            assert _leaf_types(f.type) <= {str, int, float, bool, list, dict, typing.Union, types.UnionType, type(None), Any}, (s, f)


# ---------------------------------------------------------------------------------------------
# Every command both ways


COMMANDS = [
    ["status"], ["status", "--json"], ["status", "0"], ["status", "1", "--json"], ["status", "--kube"], ["list"],
    ["list", "--json"], ["mig", "instances"], ["mig", "compute", "--json"], ["mig", "compute"], ["mig", "profiles"],
    ["mig", "profiles", "--json"], ["mig", "compute-profiles"], ["vgpu", "types"], ["vgpu", "types", "--json"],
    ["passthrough"], ["passthrough", "--json"], ["labels"], ["labels", "--json"], ["plan"], ["plan", "--json"],
    ["apply"], ["apply", "--json"], ["apply", "--wait"], ["reload"], ["reload", "--json"], ["select", "a"],
    ["apply", "-c", "a"], ["version"], ["version", "--json"], ["events"], ["events", "--json"], ["leases"],
    ["leases", "--json"], ["lease", "1g.18gb"], ["lease", "1g.18gb", "--json"], ["release", "l-1"],
    ["release", "l-1", "--json"], ["check", "--json", "LAYOUT"], ["check", "LAYOUT"],
]


def _run_all(srv: ThreadedServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, commands_: list[list[str]]) -> int:
    layout = tmp_path / "layout.yaml"
    layout.write_text("version: v1\nlayouts:\n  a: []\n")
    compared = 0
    for argv in commands_:
        full = ["--socket", srv.path, *[str(layout) if w == "LAYOUT" else w for w in argv]]
        viewed, typed = both_ways(monkeypatch, full)
        assert viewed == typed, argv
        assert viewed[0] == 0 or argv[0] == "check", (argv, viewed)
        compared += 1
    return compared


LEASE = wire_replies.LeaseInfo(id="l-1", gpu="0000:3b:00.0", index=0, profile="1g.18gb", placement="3:1",
                               uuid=MIG_UUIDS[3], devices=["/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap30"],
                               owner="job-7", uid=1000, pid=4242, created=time.time() - 3 * 86400 - 1800,
                               age_s=3 * 86400.0, state="held", note="")


def _rich(handler: Any) -> None:
    """Replies with every section a renderer has: vGPUs, leases, Kubernetes, DRA, labels, tables."""
    status: wire_replies.StatusReply = handler.replies["status"]
    gpu0, gpu1, gpu2 = status.gpus
    gpu0.leases = [LEASE]
    gpu0.dynamic = True
    gpu0.lease_free = {"1g.18gb": 2, "3g.71gb": 0}
    gpu0.mig.instances.append(wire_replies.InstanceStatus(profile="1c.3g.71gb", placement=P(start=0, size=4), gi=2,
                                                          ci=1, uuid=MIG_UUIDS[7], ci_placement=P(start=1, size=1)))
    gpu2.vgpu = wire_replies.VgpuStatus(interface="vfio", offered=["H200X-1-18C"], vfs=16, devices=[
        wire_replies.VgpuDeviceStatus(type="H200X-1-18C", vf="0000:9a:00.4", parent="0000:9a:00.4", gi=3,
                                      holders=[H(pid=900, name="qemu-system-x86", device="0000:9a:00.4", vm="vm-1")]),
        wire_replies.VgpuDeviceStatus(type="H200X-1-18C", uuid="c0ffee00-0000-4000-8000-000000000001", parent="0000:9a:00.5")],
        rebuilt=["H200X-1-18C c0ffee00-0000-4000-8000-000000000001"])
    gpu1.group.append(wire_replies.GroupMember(pci="0000:5c:00.1", driver=None, class_="0x040300"))
    status.rebuilt_after_boot = "rebuilt after boot: GPU 0 (0000:3b:00.0): MIG on, 5 instances"
    status.state_files = ["/var/lib/gpud/leases.json: set aside (not gpud's format)"]
    status.observed_at, status.observation_age = 1764800000.25, 0.00001
    status.kubernetes = wire_replies.KubernetesStatus(
        advertised=wire_replies.Advertised(resources={"nvidia.com/mig-1g.18gb": 4, "nvidia.com/mig-3g.71gb": 1},
                                           sandbox={"nvidia.com/GH100_H200_SXM_141GB": 1}, problems=["p"]),
        agent=wire_replies.KubeAgentStatus(node="n1", connected=True, selected="a", state="success", paused=["x"],
                                           other_agents=["gpu-operator/nvidia-mig-manager-abc"],
                                           workload_config="vm-passthrough", unserved=["GPU 0: no operand"]),
        dra=wire_replies.DraStatus(driver="gpu.nvidia.com", node="n1", generation=3, slices=1, devices=6, registered=None,
                                   claims=[wire_replies.DraClaimStatus(uid="u", claim="ns/c", devices=["gpu-0-mig-1"],
                                                                       leases=["l-1"])],
                                   xids=[wire_replies.DraXid(pci="0000:3b:00.0", xid=79, effect="NoSchedule", text="fell off")],
                                   taints_dropped=True))
    plan: wire_replies.PlanReply = handler.replies["plan"]
    plan.gpus[2].steps = [wire_replies.StepInfo(action="unbind", pci="0000:9a:00.0", driver="nvidia"),
                          wire_replies.StepInfo(action="bind", pci="0000:9a:00.0", driver="vfio-pci", message="m"),
                          wire_replies.StepInfo(action="create-vgpu", type="H200X-1-18C", vf="0000:9a:00.4"),
                          wire_replies.StepInfo(action="enable-vfs", count=16),
                          wire_replies.StepInfo(action="create-ci", profile="1c.3g.71gb", placement=P(start=0, size=4),
                                                gi=2, ci=1, ci_placement=P(start=1, size=1))]
    plan.gpus[1].blocked_by = [H(pid=5, name="x", device="/dev/nvidia1")]
    plan.gpus[1].dynamic = "mig-devices: dynamic: leases make the rest"
    plan.disruption.rebinds = [wire_replies.RebindInfo(pci="0000:9a:00.0", to="vfio-pci",
                                                       detached={"0000:9a:00.0": "nvidia", "0000:9a:00.1": "snd_hda_intel"},
                                                       leaves_nvml=True, mig_instances=2, vfio_group=88,
                                                       holders=[H(pid=6, name="y")], summary="s")]
    plan.disruption.vgpus_removed = [wire_replies.VgpuRemovedInfo(pci="0000:9a:00.0", type="H200X-1-18C", vf="0000:9a:00.4")]
    plan.disruption.vfs_disabled = ["0000:9a:00.0"]
    plan.disruption.reset_with = ["0000:5c:00.0"]
    plan.warnings = ["w"]
    handler.replies["passthrough"].vgpus = [wire_tables.VgpuPassthrough(
        gpu="0000:9a:00.0", type="H200X-1-18C", vf="0000:9a:00.4", resource_name="nvidia.com/H200X-1-18C",
        libvirt_hostdev="<hostdev/>", kubevirt={"resourceName": "nvidia.com/H200X-1-18C"})]
    handler.replies["passthrough"].kubevirt_configuration = {
        "permittedHostDevices": {"pciHostDevices": [{"pciVendorSelector": "10DE:2335", "externalResourceProvider": True}]},
        "mediatedDevicesConfiguration": {"enabled": False}}
    handler.replies["passthrough"].kubevirt_warnings = ["k"]
    handler.replies.update({
        "select": wire_replies.LayoutStatus(path="/etc/gpud/layout.yaml", selected="a", chosen=True, valid=True),
        "labels": wire_replies.LabelsReply(path="/etc/kubernetes/node-feature-discovery/features.d/gpud", result="written",
                                           file={"nvidia.com/gpu.count": "3", "nvidia.com/mig.capable": "true"},
                                           labels={"nvidia.com/gpu.count": "3"}, warnings=["l"]),
        "leases": wire_replies.LeasesReply(leases=[LEASE]),
        "lease": LEASE,
        "release": wire_replies.ReleaseReply(lease=LEASE, message="lease l-1 released"),
        "mig-compute-profiles": wire_tables.MigComputeProfilesReply(gpus=[wire_tables.GpuComputeProfiles(
            index=0, pci="0000:3b:00.0", model="NVIDIA H200", instances=[wire_tables.GiComputeProfiles(
                gi=2, profile="3g.71gb", placement=P(start=0, size=4), profiles=[
                    wire_tables.ComputeProfileInfo(id=0, name="1c.3g.71gb", slices=1, free=2, total=3, sms=16),
                    wire_tables.ComputeProfileInfo(id=2, name="3g.71gb", slices=3, free=0, total=1, sms=60, default=True,
                                                   ce=3, dec=3, jpg=3)])])]),
        "vgpu-types": wire_tables.VgpuTypesReply(gpus=[wire_tables.GpuVgpuTypes(index=2, pci="0000:9a:00.0", model="NVIDIA H200",
                                                                                interface="vfio", types=[
            wire_tables.VgpuTypeInfo(name="H200X-1-18C", id=1414, mig_profile="1g.18gb", framebuffer_gb=18, creatable=6, max=7),
            wire_tables.VgpuTypeInfo(name="H200X-141C", framebuffer_gb=141)])]),
    })
    handler.replies["mig-profiles"].gpus.append(wire_tables.GpuProfiles(
        index=2, pci="0000:9a:00.0", model="NVIDIA H200", source="table",
        profiles=[wire_tables.ProfileInfo(id=19, name="1g.18gb", memory_mb=16384, unknown=["sms", "placements"])]))
    handler.publish("step", "create-gi 1g.18gb@3:1", "0000:3b:00.0", steps=3)
    handler.publish("converged", "all GPUs converged")


def test_every_command_prints_the_same_as_from_the_typed_decode(monkeypatch, tmp_path):
    srv = ThreadedServer(group=None).start()
    try:
        _rich(srv.handler)
        assert _run_all(srv, monkeypatch, tmp_path, COMMANDS) == len(COMMANDS)
        # and the text a person sees has every outside string escaped, both ways
        srv.handler.replies["status"].gpus[1].holders[0].name = "py\x1b[2Jthon\nforged"
        srv.handler.replies["passthrough"].devices[0].libvirt_hostdev += "\n<!-- \x1b -->"
        assert _run_all(srv, monkeypatch, tmp_path, [["status"], ["status", "1"], ["passthrough"], ["status", "--json"]]) == 4
    finally:
        srv.stop()


def test_the_replies_of_gpud_on_the_real_h200_print_the_same(monkeypatch, tmp_path):
    """Recorded on the lent H200 by an earlier gpud (tests/fixtures/h200-gpud-readonly): sent as
    recorded, the fields added since are missing and take the struct's default both ways (`--json`
    prints what gpud sent, the typed decode printed every field of today's struct); then as the
    struct they decode to, every field present."""
    recorded = {op: json.loads((H200 / f"gpudctl-{op}.json").read_text()) for op in ("status", "plan", "version")}
    missing = set(msgspec.structs.asdict(wire_replies.decode_result("status", recorded["status"]))) - set(recorded["status"])
    assert missing, "the recording has every field of today's StatusReply: it no longer tests the defaults"
    text = [["status"], ["status", "0"], ["status", "--kube"], ["list"], ["mig", "instances"], ["plan"], ["version"]]
    srv = ThreadedServer(group=None).start()
    try:
        for op, doc in recorded.items():
            srv.handler.replies[op] = doc
        # the server sends only its own op's struct: an older gpud's map passes as one here
        with monkeypatch.context() as m:
            m.setattr(server, "wire_replies", types.SimpleNamespace(RESULTS=dict.fromkeys(recorded, object)))
            assert _run_all(srv, monkeypatch, tmp_path, text) == len(text)
            viewed, typed = both_ways(monkeypatch, ["--socket", srv.path, "status", "--json"])
        sent, filled = json.loads(viewed[1]), json.loads(typed[1])
        assert sent == recorded["status"] and set(filled) - set(sent) == missing
        assert _within(sent, filled)
        for op, doc in recorded.items():
            srv.handler.replies[op] = wire_replies.decode_result(op, doc)
        assert _run_all(srv, monkeypatch, tmp_path, [*text, ["status", "--json"], ["plan", "--json"]]) == len(text) + 2
    finally:
        srv.stop()


def _within(sent: Any, filled: Any) -> bool:
    """Everything of `sent` is in `filled` as it is: `filled` only adds keys to maps."""
    if isinstance(sent, dict):
        return isinstance(filled, dict) and all(k in filled and _within(v, filled[k]) for k, v in sent.items())
    if isinstance(sent, list):
        return isinstance(filled, list) and len(sent) == len(filled) and all(map(_within, sent, filled))
    return sent == filled and type(sent) is type(filled)


# ---------------------------------------------------------------------------------------------
# Fields an older gpud did not send


def _raw(op: str, obj: Any) -> Any:
    """`obj` as gpud sends it and gpudctl decodes it: msgspec's encoder, msgpack's decoder."""
    import msgpack

    return msgpack.unpackb(wire.encode_frame(obj)[frames.HEADER.size:])


def test_a_field_the_map_lacks_takes_the_structs_default_and_unknown_fields_are_ignored():
    from tests.api.fakes import status_reply

    raw = _raw("status", status_reply())
    del raw["state_files"], raw["layout"]["warnings"], raw["gpus"][0]["mig"], raw["gpus"][1]["vfio_device"]
    del raw["gpus"][0]["group"][0]["class"]
    raw["gpus"][0]["added_in_a_later_version"] = {"x": 1}
    viewed, typed = view.reply("status", raw), wire_replies.decode_result("status", raw)
    assert viewed.state_files == typed.state_files == []
    assert viewed.layout.warnings == typed.layout.warnings == []
    assert viewed.gpus[0].mig == msgspec.to_builtins(typed.gpus[0].mig) and viewed.gpus[0].mig.instances == []
    assert viewed.gpus[1].vfio_device is typed.gpus[1].vfio_device is None
    assert viewed.gpus[0].group[0].class_ == typed.gpus[0].group[0].class_ == ""
    assert viewed.gpus[1].group[0].class_ == "0x030200"  # `class` on the wire
    event = view.reply(view.EVENT, {"time": 1.5, "kind": "step"})
    assert (event.gpu, event.message, event.data) == (None, "", {})
    with pytest.raises(AttributeError):
        viewed.no_such_field  # noqa: B018
    with pytest.raises(AttributeError):  # a map inside a `dict[str, Any]` field: no struct says what it holds
        view.reply("passthrough", {"devices": [{"pci": "p", "vendor_device": "v", "kubevirt": {"a": {}}}]}).devices[0].kubevirt.a.b  # noqa: B018


def test_a_required_field_the_map_lacks_is_a_malformed_reply():
    raw = _raw("status", wire_replies.StatusReply(phase="converged", layout=wire_replies.LayoutStatus(path="/l")))
    del raw["layout"]["path"]
    with pytest.raises(frames.FrameError, match=r"malformed status result from gpud: layout\.path is missing"):
        view.reply("status", raw).layout.path  # noqa: B018
    with pytest.raises(wire.FrameError):  # msgspec's decode refused it as well
        wire_replies.decode_result("status", raw)
