"""Prometheus metrics in the node exporter's textfile format.

Bare-metal hosts already run prometheus-node-exporter; its textfile collector picks up
`*.prom` files from a directory, so gpud needs no listening port (its unit allows no IP at all).
The file is rewritten atomically after every pass and layout change, from the same
`wire_replies.StatusReply` that `gpudctl status` reads, so the two never disagree. The text comes from
prometheus_client (`generate_latest`), the write from `gpud.host.files.safe_file`: the textfile directory
often belongs to the exporter's user, and prometheus_client's own `write_to_textfile` opens a
predictable temp name with a plain open(), which follows a link planted there (root would
overwrite any file). A directory others may write is refused (OSError naming the reason).
"""

from __future__ import annotations

from collections import Counter
from typing import get_args

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from gpud.engine.gpu_state import GpuStateName
from gpud.host.files.safe_file import write_file
from gpud.wire import replies as wire_replies

# Every GPU gets one `gpud_gpu_state` row per state the engine can report, exactly one of them 1.
STATES: tuple[str, ...] = get_args(GpuStateName)


def render(status: wire_replies.StatusReply, passes: int, path: str) -> None:
    """Write the metrics of one status snapshot to `path`."""
    reg = CollectorRegistry()
    layout_valid = Gauge("gpud_layout_valid", "1 when the layout file in place is valid", registry=reg)
    gpus = Gauge("gpud_gpus", "Managed GPUs", registry=reg)
    state = Gauge("gpud_gpu_state", "1 for the state the GPU is in", ["pci", "index", "model", "state"], registry=reg)
    holders = Gauge("gpud_gpu_holders", "Processes gpud waits for on this GPU", ["pci"], registry=reg)
    mig = Gauge("gpud_mig_devices", "MIG devices by profile", ["pci", "profile"], registry=reg)
    mode = Gauge("gpud_mig_enabled", "1 when MIG mode is enabled", ["pci"], registry=reg)
    driver = Gauge("gpud_gpu_driver", "1 for the driver the GPU is bound to", ["pci", "driver"], registry=reg)
    runs = Gauge("gpud_reconcile_passes", "Reconcile passes since start", registry=reg)
    leases = Gauge("gpud_leases", "Leases on a dynamic GPU, by profile (gpudctl lease)", ["pci", "profile"],
                   registry=reg)
    free = Gauge("gpud_lease_free", "More leases of a GI profile that fit on a dynamic GPU now",
                 ["pci", "profile"], registry=reg)
    layout_valid.set(1 if status.layout.valid else 0)
    gpus.set(sum(g.state != "gone" for g in status.gpus))  # a gone GPU keeps its row, not its count
    runs.set(passes)
    for g in status.gpus:
        for s in STATES:
            state.labels(g.pci, str(g.index), g.model, s).set(1 if g.state == s else 0)
        holders.labels(g.pci).set(len(g.holders))
        driver.labels(g.pci, g.driver or "none").set(1)
        if g.mig.capable:
            mode.labels(g.pci).set(1 if g.mig.mode == "enabled" else 0)
        for profile, n in Counter(i.profile for i in g.mig.instances).items():
            mig.labels(g.pci, profile).set(n)
        for profile, n in Counter(x.profile for x in g.leases).items():
            leases.labels(g.pci, profile).set(n)
        for profile, n in g.lease_free.items():
            free.labels(g.pci, profile).set(n)
    write_file(path, generate_latest(reg), mode=0o644)
