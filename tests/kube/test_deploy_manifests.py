"""The shipped Kubernetes manifests (deploy/, packaging/kube/) against gpud's own code and a real
kube-apiserver: every request the agents' code makes is allowed by the RBAC files (read from the
code's lightkube calls, not listed by hand), every host path gpud writes is mounted read-write from
the host in the DaemonSet (read from gpud's defaults), the DaemonSet's arguments parse as gpud's
command line, and each manifest is accepted by a real kube-apiserver in a server-side dry run."""

from __future__ import annotations

import ast
import importlib
import json
import urllib.error
from pathlib import Path, PurePosixPath

import pytest
import yaml

from tests.support.kube_real_server import REPO

MANIFESTS = sorted([*(REPO / "deploy").rglob("*.yaml"), *(REPO / "packaging" / "kube").glob("*.yaml")])
RBAC = REPO / "packaging" / "kube" / "gpud-rbac.yaml"
DRA_RBAC = REPO / "deploy" / "dra" / "gpud-dra-rbac.yaml"
DAEMONSET = REPO / "deploy" / "daemonset.yaml"
TOKEN = REPO / "packaging" / "kube" / "gpud-token.yaml"
# lightkube's client method -> the API verb it sends (lightkube.core.async_client)
VERB = {"get": "get", "list": "list", "watch": "watch", "create": "create", "delete": "delete",
        "patch": "patch", "apply": "patch", "replace": "update", "deletecollection": "deletecollection"}


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def requests_in(module: str) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every `self._client.<method>(Resource, ...)` in `module`'s
    source; a resource passed as a variable is found where that variable is assigned."""
    path = REPO / (module.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text())
    resources: dict[str, type] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightkube.resources."):
            mod = importlib.import_module(node.module or "")
            resources.update({a.name: getattr(mod, a.name) for a in node.names})
    assigned: dict[str, ast.AST] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    assigned[t.id] = node.value

    def resource_of(arg: ast.AST) -> type:
        if isinstance(arg, ast.Name) and arg.id in assigned and arg.id not in resources:
            arg = assigned[arg.id]
        names = {n.id for n in ast.walk(arg) if isinstance(n, ast.Name) and n.id in resources}
        assert len(names) == 1, f"{path}: cannot tell the resource of {ast.unparse(arg)}"
        return resources[names.pop()]

    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) and f.value.attr == "_client"
                and f.attr in VERB):
            info = resource_of(node.args[0])._api_info  # type: ignore[attr-defined]  # lightkube's resource classes
            out.add((info.resource.group, info.plural, VERB[f.attr]))
    return out


def allowed(*files: Path, account: tuple[str, str]) -> set[tuple[str, str, str]]:
    """What the ClusterRoles bound to ServiceAccount `account` (namespace, name) in `files` allow."""
    all_docs = [d for p in files for d in docs(p)]
    roles = {d["metadata"]["name"]: d for d in all_docs if d["kind"] == "ClusterRole"}
    out = set()
    for b in (d for d in all_docs if d["kind"] == "ClusterRoleBinding"):
        if not any(s["kind"] == "ServiceAccount" and (s["namespace"], s["name"]) == account for s in b["subjects"]):
            continue
        for rule in roles[b["roleRef"]["name"]]["rules"]:
            out |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return out


def daemonset() -> dict:
    (ds,) = [d for d in docs(DAEMONSET) if d["kind"] == "DaemonSet"]
    return ds


def host_mounts(ds: dict) -> dict[str, tuple[str, bool]]:
    """mountPath -> (the host path behind it, read-only) for the container's hostPath mounts."""
    pod = ds["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (c,) = pod["containers"]
    return {m["mountPath"]: (volumes[m["name"]]["hostPath"]["path"], bool(m.get("readOnly")))
            for m in c["volumeMounts"] if "hostPath" in volumes[m["name"]]}


def run_is_var_run(p: str) -> str:
    """/var/run is a link to /run on every systemd host (and in Debian's images)."""
    return "/run" + p[len("/var/run"):] if p == "/var/run" or p.startswith("/var/run/") else p


def writable_on_host(mounts: dict[str, tuple[str, bool]], path: str) -> bool:
    p = PurePosixPath(run_is_var_run(path))
    for mount, (host, ro) in mounts.items():
        m = PurePosixPath(run_is_var_run(mount))
        if p == m or m in p.parents:
            return not ro and PurePosixPath(run_is_var_run(host)) / p.relative_to(m) == p
    return False


def test_every_manifest_parses_and_names_its_kind():
    assert {DAEMONSET, RBAC, DRA_RBAC, TOKEN} <= set(MANIFESTS)
    for path in MANIFESTS:
        for d in docs(path):
            assert d.get("apiVersion") and d.get("kind") and d.get("metadata", {}).get("name"), (path, d)


def test_rbac_allows_every_request_the_kube_agent_makes():
    needed = requests_in("gpud.host.kube.node_api")
    # the agent's reads, its node patches, pod deletions and the node Event, as the code makes them
    assert {("", "nodes", "patch"), ("", "pods", "delete"), ("", "events", "create")} <= needed
    have = allowed(RBAC, account=("kube-system", "gpud"))
    assert needed <= have, f"requests the RBAC file does not allow: {sorted(needed - have)}"
    assert have <= needed, f"verbs granted that the code never uses: {sorted(have - needed)}"


def test_dra_rbac_allows_every_request_the_dra_driver_makes():
    needed = requests_in("gpud.host.kube.dra_api")
    assert ("resource.k8s.io", "resourceslices", "update") in needed
    have = allowed(DRA_RBAC, account=("kube-system", "gpud"))
    assert needed <= have, f"requests the DRA RBAC file does not allow: {sorted(needed - have)}"


def test_daemonset_runs_as_the_documented_identity_privileged_on_gpu_nodes():
    ds = daemonset()
    pod = ds["spec"]["template"]["spec"]
    (sa,) = [d for d in docs(RBAC) if d["kind"] == "ServiceAccount"]
    assert (ds["metadata"]["namespace"], pod["serviceAccountName"]) == (sa["metadata"]["namespace"],
                                                                        sa["metadata"]["name"])
    assert pod["hostPID"] is True
    (c,) = pod["containers"]
    assert c["securityContext"]["privileged"] is True
    assert pod["nodeSelector"], "the DaemonSet must select GPU nodes only"
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()


def test_daemonset_arguments_are_gpuds_command_line():
    from gpud.daemon import parse_args

    (c,) = daemonset()["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    args = parse_args([a.replace("$(NODE_NAME)", "gpu-node-1") for a in c["args"]])
    assert args.kube_node == "gpu-node-1"
    assert args.sim is None and not args.read_only


def test_daemonset_mounts_every_host_path_gpud_writes():
    """The paths come from gpud's defaults; each must reach the same path on the host, writable."""
    from gpud import hardware
    from gpud.daemon import DaemonConfig
    from gpud.engine.dra.driver import DEFAULT_CDI_DIR

    d = DaemonConfig()
    writes = {
        "socket": d.socket, "state": d.state_dir, "apply lock": hardware.APPLY_LOCK,
        "udev rules": hardware.UDEV_RULES, "NFD features": hardware.NFD_FEATURES,
        "CDI specs": DEFAULT_CDI_DIR + "/nvidia.yaml", "DRA plugin": d.kubelet_root + "/plugins_registry",
        "sysfs": "/sys/bus/pci/drivers_probe", "devices": "/dev/vfio",
        "system bus": _system_bus_socket(),
    }
    mounts = host_mounts(daemonset())
    missing = {what: p for what, p in writes.items() if not writable_on_host(mounts, p)}
    assert not missing, f"host paths gpud writes that the DaemonSet does not mount read-write: {missing}"
    # the layout file is read from the ConfigMap at the path gpud reads by default
    (c,) = daemonset()["spec"]["template"]["spec"]["containers"]
    layout = {m["mountPath"] for m in c["volumeMounts"] if m["name"] == "layout"}
    assert layout == {str(PurePosixPath(d.config).parent)}
    from gpud.host.nvidia.sriov_manage import DEFAULT_PATH

    assert str(PurePosixPath(DEFAULT_PATH).parent) in mounts


def _system_bus_socket() -> str:
    """Where dbus-fast finds the system bus when nothing overrides it (what gpud connects to)."""
    import os

    from dbus_fast import BusType
    from dbus_fast._private.address import get_bus_address, parse_address

    saved = os.environ.pop("DBUS_SYSTEM_BUS_ADDRESS", None)
    try:
        ((_, opts),) = parse_address(get_bus_address(BusType.SYSTEM))
    finally:
        if saved is not None:
            os.environ["DBUS_SYSTEM_BUS_ADDRESS"] = saved
    return opts["path"]


def test_token_secret_is_the_kind_that_does_not_expire():
    (s,) = docs(TOKEN)
    (sa,) = [d for d in docs(RBAC) if d["kind"] == "ServiceAccount"]
    assert s["kind"] == "Secret" and s["type"] == "kubernetes.io/service-account-token"
    assert s["metadata"]["namespace"] == sa["metadata"]["namespace"]
    assert s["metadata"]["annotations"]["kubernetes.io/service-account.name"] == sa["metadata"]["name"]
    readme = (REPO / "README.md").read_text()
    assert "packaging/kube/gpud-token.yaml" in readme and "secret gpud-token" in readme


# --- a real kube-apiserver ------------------------------------------------------------------------
API_PATHS = {"DaemonSet": "/apis/apps/v1/namespaces/{ns}/daemonsets",
             "Secret": "/api/v1/namespaces/{ns}/secrets",
             "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
             "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
             "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
             "DeviceClass": "/apis/resource.k8s.io/v1/deviceclasses"}


@pytest.mark.apiserver
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(REPO)))
def test_real_apiserver_accepts_each_manifest_in_a_dry_run(real_server, path):
    """A server-side dry run (dryRun=All): the server's own validation and admission, nothing
    stored. A name the session's server already has (the RBAC file it applied) is renamed."""
    for d in docs(path):
        d = json.loads(json.dumps(d))
        d["metadata"]["name"] += "-dry-run"
        url = API_PATHS[d["kind"]].format(ns=d["metadata"].get("namespace")) + "?dryRun=All&fieldValidation=Strict"
        try:
            got = real_server.admin("POST", url, d)
        except urllib.error.HTTPError as err:
            with err:
                pytest.fail(f"{path}: {d['kind']} refused: {err.code} {err.read().decode()[:500]}")
        assert got["kind"] == d["kind"] and got["metadata"]["name"] == d["metadata"]["name"]
        with pytest.raises(urllib.error.HTTPError) as e:  # dry run: nothing was stored
            real_server.admin("GET", API_PATHS[d["kind"]].format(ns=d["metadata"].get("namespace"))
                              + "/" + d["metadata"]["name"])
        with e.value:  # the error holds the response's connection
            assert e.value.code == 404


def test_kubevirt_page_samples_parse_and_use_gpuds_entries():
    """docs/kubevirt.md's YAML parses; its permittedHostDevices entries have the keys gpud's own
    entries have, and the VM asks for a resource the KubeVirt CR permits."""
    import re

    from gpud.engine.binding.passthrough import PassthroughEntry, kubevirt_entry

    page = (REPO / "docs" / "kubevirt.md").read_text()
    assert "(docs/kubevirt.md)" in (REPO / "README.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", page, re.S)]
    (kv,) = [b for b in blocks if b["kind"] == "KubeVirt"]
    (vm,) = [b for b in blocks if b["kind"] == "VirtualMachine"]
    phd = kv["spec"]["configuration"]["permittedHostDevices"]
    assert kv["spec"]["configuration"]["mediatedDevicesConfiguration"] == {"enabled": False}
    from gpud.kubevirt_names import kubevirt_name

    h200 = kubevirt_name(0x2335)  # the plugin's name for the H200 SXM the sample passes through
    sample = kubevirt_entry(PassthroughEntry(
        pci="0000:1b:00.0", index=0, vendor_device="10DE:2335", device_name=h200.pci_ids_name or "",
        resource_name=h200.resource, iommu_group=1, vfio_device="/dev/vfio/1", numa_node=0, companions=(),
        libvirt_hostdev="", name_source=h200.source))
    whole, vf = phd["pciHostDevices"]
    assert whole == sample
    # the SR-IOV vGPU entry: KubeVirt's own plugin (not external), the resource named as gpud names it
    from gpud.kubevirt_names import vgpu_resource
    assert set(vf) == set(sample) and vf["externalResourceProvider"] is False
    assert vf["resourceName"] == vgpu_resource("NVIDIA L40S-12Q")
    permitted = {e["resourceName"] for kind in phd.values() for e in kind}
    gpus = vm["spec"]["template"]["spec"]["domain"]["devices"]["gpus"]
    assert {g["deviceName"] for g in gpus} <= permitted
