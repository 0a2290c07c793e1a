"""NVIDIA's own tools on gpud's simulated host, side by side with gpud: nvidia-mig-parted
(v0.15.0) and gpu-feature-discovery (k8s-device-plugin v0.20.0), installed by scripts/install-anchors
(make test runs it). Each is the oracle here: mig-parted's apply must converge the host as
state.json records it and gpud must then see nothing to do; gpud's apply must satisfy
mig-parted's assert and export; GFD's labels must equal gpud's, but for docs/kubernetes.md's list.
A test skips only when its tool is absent, with the reason install-anchors recorded.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import yaml

from gpud.profiles import MODELS
from gpud.sim import catalog
from gpud.sim.state import load
from tests.support.anchors import anchor
from tests.support.daemon import DaemonOn, wait_until
from tests.support.nvmlc import gpud_sim_exec
from tests.support.present import present

pytestmark = pytest.mark.tools

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "mig-parted"
# GFD labels gpud does not write, and why (docs/kubernetes.md lists the same).
GFD_ONLY = {
    "nvidia.com/gpu.machine",  # the host's DMI product name: not the GPU's, and the simulator has none
}


def per_gpu(config: dict, label: str, models: list[str]) -> list[tuple[bool, Counter]] | None:
    """What each GPU (by index) must end as under `label`, from the config alone; None when the
    label does not fit these models (a device-filter names none of them, or a profile they lack)."""
    want: list[tuple[bool, Counter] | None] = [None] * len(models)
    for entry in config["mig-configs"][label]:
        filt = entry.get("device-filter")
        filters = {f.lower() for f in ([filt] if isinstance(filt, str) else filt or [])}
        devices = range(len(models)) if entry["devices"] == "all" else entry["devices"]
        for i in devices:
            if i >= len(models):
                return None
            m = MODELS[models[i]]
            if filters and f"0x{m.device:04x}10de" not in filters:
                continue
            names = {p.name for p in m.profiles}
            devs = entry.get("mig-devices") or {}
            if not m.mig_capable or any(n not in names for n in devs):
                return None
            want[i] = (bool(entry["mig-enabled"]), Counter(devs))
    return None if any(w is None for w in want) else want  # type: ignore[return-value]


def observed(host: Path) -> list[tuple[bool, Counter]]:
    """Each GPU's MIG mode and GPU instances by profile name, from the simulator's own state file."""
    st = load(host)
    out = []
    for address in sorted(st.gpus):
        g = st.gpus[address]
        names = {p.id: p.name for p in MODELS[g.model].profiles}
        out.append((g.mig_mode == 1, Counter(names[gi.profile_id] for gi in g.gis)))
    return out


def _pairs() -> list[tuple[str, str, str]]:
    """(file, label, model) for every label of the carried configs and every simulated model it
    fits, once per distinct MIG table and target (two labels asking the same of a model, or two
    models serving one table, are one case: CI time goes to distinct work)."""
    files = {f.name: yaml.safe_load(f.read_text()) for f in sorted(CONFIGS.glob("*.yaml"))}
    tables: dict[tuple, str] = {}
    for key in catalog.offered():
        if MODELS[key].mig_capable:
            tables.setdefault(MODELS[key].profiles, key)
    seen: set[tuple] = set()
    out = []
    for name, config in files.items():
        for label in config["mig-configs"]:
            for key in tables.values():
                want = per_gpu(config, label, [key])
                if want is not None and (key, repr(want)) not in seen:
                    seen.add((key, repr(want)))
                    out.append((name, label, key))
    return out


PAIRS = _pairs()


def test_the_configs_fit_some_models():
    assert len(PAIRS) > 20 and {p[2] for p in PAIRS} >= {"a100-40gb", "h100-80gb", "h200", "a30"}


@pytest.mark.parametrize(("file", "label", "model"), PAIRS, ids=[f"{f}:{lab}:{m}" for f, lab, m in PAIRS])
def test_mig_parted_apply_converges_and_gpud_agrees(tmp_path, sim_dir, nvml_so, file, label, model):
    tool = anchor("nvidia-mig-parted")
    cfg = CONFIGS / file
    config = yaml.safe_load(cfg.read_text())
    want = per_gpu(config, label, [model])
    host = sim_dir(model)
    res = gpud_sim_exec(host, str(tool), "apply", "-f", str(cfg), "-c", label, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert [(on, +c) for on, c in observed(host)] == [(on, +c) for on, c in present(want)]
    layout = cfg.read_text() + f"selected: {label}\n"
    d = DaemonOn(tmp_path / "gpud-after", host, layout, ["--read-only"])
    try:
        plan = json.loads(d.ctl("plan", "--json").stdout)
        assert [g["steps"] for g in plan["gpus"]] == [[]]
        wait_until(lambda: {g["state"] for g in d.status()["gpus"]} != {"starting"}, what="gpud's first look")
        assert {g["state"] for g in d.status()["gpus"]} == {"converged"}
    finally:
        d.stop()

    # the other way round: gpud applies, mig-parted asserts and exports the same layout
    host2 = sim_dir(model)
    d = DaemonOn(tmp_path / "gpud-applies", host2, layout)
    try:
        r = d.ctl("apply", "--wait", "--timeout", "240", timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        d.stop()
    res = gpud_sim_exec(host2, str(tool), "assert", "-f", str(cfg), "-c", label)
    assert res.returncode == 0, res.stdout + res.stderr
    res = gpud_sim_exec(host2, str(tool), "export")
    assert res.returncode == 0, res.stderr
    exported = yaml.safe_load(res.stdout)["mig-configs"]["current"]
    got: list[tuple[bool, Counter] | None] = [None]
    for entry in exported:
        for i in (range(1) if entry["devices"] == "all" else entry["devices"]):
            got[i] = (bool(entry["mig-enabled"]), +Counter(entry.get("mig-devices") or {}))
    assert got == [(on, +c) for on, c in present(want)]


GFD_CASES = [(key, strategy) for key in catalog.offered() for strategy in ("single", "mixed")]


def _labels(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


@pytest.mark.parametrize(("model", "strategy"), GFD_CASES, ids=[f"{m}:{s}" for m, s in GFD_CASES])
def test_gfd_labels_equal_gpuds(tmp_path, sim_dir, nvml_so, model, strategy):
    """Two GPUs: with MIG, single: both 1g x all of the smallest profile; mixed: GPU 0 split, GPU 1
    whole. gpud writes GFD's labels (--nfd-labels all) after its apply; GFD reads the same host."""
    tool = anchor("gpu-feature-discovery")
    m = MODELS[model]
    host = sim_dir(f"{model}:2")
    if m.mig_capable:
        small = min(m.profiles, key=lambda p: (p.slices, p.name))
        gpu0 = f"{{devices: [0], mig-enabled: true, mig-devices: {{'{small.name}': 1}}}}"
        gpu1 = (f"{{devices: [1], mig-enabled: true, mig-devices: {{'{small.name}': 1}}}}" if strategy == "single"
                else "{devices: [1], mig-enabled: false}")
        layout = f"version: v1\nlayouts:\n  t:\n    - {gpu0}\n    - {gpu1}\n"
    else:
        layout = "version: v1\nlayouts:\n  t:\n    - {devices: all}\n"
    (host / "etc/kubernetes/node-feature-discovery/features.d").mkdir(parents=True)
    d = DaemonOn(tmp_path / "gpud", host, layout, ["--nfd-labels", "all", "--mig-strategy", strategy])
    try:
        r = d.ctl("apply", "--wait", "--timeout", "240", timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        features = host / "etc/kubernetes/node-feature-discovery/features.d/gpud"
        wait_until(features.is_file, what="gpud's feature file")
        ours = _labels(features.read_text())
    finally:
        d.stop()
    machine = tmp_path / "product_name"
    machine.write_text("simulated\n")
    out = tmp_path / "gfd-labels"
    res = gpud_sim_exec(host, str(tool), "--oneshot", "--no-timestamp", "--output-file", str(out),
                        "--use-node-feature-api=false", "--device-discovery-strategy=nvml",
                        f"--mig-strategy={strategy}", f"--machine-type-file={machine}", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    theirs = _labels(out.read_text())
    ours_gfd = {k: v for k, v in ours.items() if not k.startswith("nvidia.com/gpud.")}
    assert {k: v for k, v in theirs.items() if k not in GFD_ONLY} == ours_gfd


def test_the_device_plugin_is_installed_by_name():
    """The device plugin's enumeration is not compared yet (docs/nvml-c-library.md says why); its
    binary is still installed and must start far enough to print its version line. The number in it
    comes from the upstream Makefile's `-X .../info.version=` (internal/info/version.go), which
    `go install` does not pass, so it reads "unknown" there; the module version is checked by
    scripts/install-anchors through `go version -m`."""
    tool = anchor("nvidia-device-plugin")
    res = subprocess.run([str(tool), "--version"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "NVIDIA Device Plugin version" in res.stdout + res.stderr
