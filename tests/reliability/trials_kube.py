"""Round 4's Kubernetes faults, against a real kube-apiserver (tests/support/kube_real_server.py,
its own etcd, watches served by etcd itself so a compaction reaches them): a gpud process with
--kube-node on a simulated 2 x H100 80GB host, its layout file a ConfigMap volume written as the
kubelet writes one (tests/support/configmap_volume.py), its API traffic through a TLS proxy of the
test's own (below) that can shorten watches.

Faults: the `nvidia.com/mig.config` label flapped during an apply; the ConfigMap deleted mid-apply
(kept by the kubelet, removed as an optional one, or re-created with other content); the API server
stopped (a minute at full scale); a storm of 410s (etcd compacted while every watch of gpud's ends
within 2 s, so each re-opened watch asks for a version the server no longer has).

Promise, the same for all: once the fault is over, the node's state label says `success` for the
label's last value, and the hardware (the simulator's own state.json, through NVIDIA's GI profile
ids: trials.hardware_mismatches) is exactly that layout as the volume holds it last; gpud's socket
answered throughout. Label values and ConfigMaps are written as an admin, read back fresh.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import ssl
import time
import urllib.error
from pathlib import Path

import yaml

from gpud.engine.kube.agent import MIG_CONFIG, MIG_STATE
from tests.reliability.trials import TrialResult, crashed, hardware_mismatches, layout_entries, serving
from tests.support.configmap_volume import ConfigMapVolume
from tests.support.daemon import Daemon
from tests.support.kube_cluster import NODE
from tests.support.kube_real_cluster import LoopThread, RealNode
from tests.support.kube_real_server import RealServer, binaries, free_port, have_openssl

GPUS = ["0000:18:00.0", "0000:2a:00.0"]
NS, CM, KEY = "gpu-operator", "gpud-layout", "config.yaml"

# Two contents of the ConfigMap: the same names, other layouts (a ConfigMap re-created with other
# content must be followed for the name the label already selects).
CONTENTS: list[dict[str, list[dict[str, int] | None]]] = [
    {"a": [{"3g.40gb": 2}, {"7g.80gb": 1}], "b": [{"1g.10gb": 7}, {"3g.40gb": 2}],
     "c": [{"4g.40gb": 1, "2g.20gb": 1}, {"1g.10gb": 7}], "d": [None, {"4g.40gb": 1}]},
    {"a": [{"1g.10gb": 7}, None], "b": [{"4g.40gb": 1}, {"4g.40gb": 1, "2g.20gb": 1}],
     "c": [None, {"3g.40gb": 2}], "d": [{"7g.80gb": 1}, {"1g.10gb": 7}]},
]
NAMES = sorted(CONTENTS[0])


def layouts_text(content: dict[str, list[dict[str, int] | None]]) -> str:
    """The layout file: every name, no `selected` (under --kube-node the node label selects)."""
    out = {"version": "v1", "layouts": {name: layout_entries(per_gpu) for name, per_gpu in content.items()}}
    return yaml.safe_dump(out, sort_keys=False)


class WatchShortener:
    """A TLS proxy in front of the API server (its own certificate, the server's CA): requests go
    through unchanged but for a watch's `timeoutSeconds`, cut to `watch_s` when set, so the server
    ends each watch of gpud's cleanly within seconds and the client re-opens it from the last
    version it saw (what a watch that expired does). Counts the 410 Status objects the server sent."""

    def __init__(self, server: RealServer) -> None:
        self.server = server
        self.port = free_port()
        self.watch_s: int | None = None
        self.gone = 0  # 410 Status objects the server answered gpud
        self._open: set[asyncio.StreamWriter] = set()
        self._tls_in = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._tls_in.load_cert_chain(server.certs / "server.crt", server.certs / "server.key")
        self._tls_out = ssl.create_default_context(cafile=str(server.certs / "ca.crt"))
        self.loop = LoopThread()
        self._srv = self.loop.call(asyncio.start_server(self._conn, "127.0.0.1", self.port, ssl=self._tls_in))

    def kubeconfig(self, path: Path) -> str:
        self.server.kubeconfig(path)
        doc = yaml.safe_load(path.read_text())
        doc["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{self.port}"
        path.write_text(yaml.safe_dump(doc))
        return str(path)

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.server.port, ssl=self._tls_out)
        except OSError:  # the server is down: the client sees its connection refused, as it would
            writer.close()
            return
        self._open |= {writer, up_w}
        try:
            await asyncio.gather(self._pipe(reader, up_w, self._request), self._pipe(up_r, writer, self._response),
                                 return_exceptions=True)
        finally:
            self._open -= {writer, up_w}

    def cut(self) -> None:
        """Drop every connection now (the watches opened before `watch_s` was set included)."""
        async def cut() -> None:
            for w in list(self._open):
                w.transport.abort()

        self.loop.call(cut())

    def _request(self, data: bytes) -> bytes:
        if self.watch_s is not None and b"watch=" in data:
            data = re.sub(rb"timeoutSeconds=\d+", b"timeoutSeconds=%d" % self.watch_s, data)
        return data

    def _response(self, data: bytes) -> bytes:
        self.gone += len(re.findall(rb'"code":\s*410', data))
        return data

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, edit) -> None:
        try:
            while data := await src.read(65536):
                dst.write(edit(data))
                await dst.drain()
        finally:
            dst.close()

    def close(self) -> None:
        self._srv.close()
        self.loop.close()


class KubeHost:
    """The real server, the node, the ConfigMap and its volume, and gpud on the simulated host."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.server = RealServer(tmp / "kube-apiserver", watch_cache=False).start()
        self.node = RealNode(self.server, tmp, NODE)
        self.proxy = WatchShortener(self.server)
        self.volume = ConfigMapVolume(tmp / "cm")
        self.content = 0
        self.node.put_node({MIG_CONFIG: "a"})
        self.put_configmap(0)
        self.sync_volume()
        self.d = Daemon(tmp / "d", ["h100-80gb:2"], layouts_text(CONTENTS[0]),
                        ["--kube-node", NODE, "--kubeconfig", self.proxy.kubeconfig(tmp / "gpud-proxy.kubeconfig"),
                         "--nfd-features", str(tmp / "none" / "gpud"), "--config", str(self.volume.path(KEY))])

    def close(self) -> None:
        try:
            self.d.stop()
        finally:
            self.node.close()
            self.proxy.close()
            self.server.stop()

    # --- the cluster, as an admin and as the kubelet ---------------------------------------
    def put_configmap(self, content: int) -> None:
        self.server.admin("POST", f"/api/v1/namespaces/{NS}/configmaps",
                          {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": CM},
                           "data": {KEY: layouts_text(CONTENTS[content])}})

    def delete_configmap(self) -> None:
        self.server.admin("DELETE", f"/api/v1/namespaces/{NS}/configmaps/{CM}")

    def sync_volume(self, optional: bool = False) -> None:
        """The kubelet's periodic sync of the volume: the ConfigMap as the server has it now; a
        deleted one is kept (projected empty when the volume says `optional: true`)."""
        try:
            data = self.server.admin("GET", f"/api/v1/namespaces/{NS}/configmaps/{CM}")["data"]
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
            if optional:
                self.volume.write({})
            return
        self.volume.write(dict(data))
        self.content = next(i for i, c in enumerate(CONTENTS) if layouts_text(c) == data[KEY])

    def label(self, value: str) -> None:
        self.node.merge_labels({MIG_CONFIG: value})

    # --- what holds ------------------------------------------------------------------------
    def wrong(self, value: str) -> list[str]:
        """What differs from `value` applied: the state label, the hardware."""
        labels = self.node.labels()
        out = []
        if labels.get(MIG_CONFIG) != value:
            out.append(f"label {labels.get(MIG_CONFIG)!r}, wanted {value!r}")
        if labels.get(MIG_STATE) != "success":
            out.append(f"state label {labels.get(MIG_STATE)!r}")
        out += hardware_mismatches(self.d, CONTENTS[self.content][value], GPUS)
        return out

    def settled(self, value: str, limit: float = 240.0) -> list[str]:
        """[] once `value` is applied and reported (the socket answering at every look); else what
        still differs when `limit` runs out."""
        deadline = time.monotonic() + limit
        while True:
            wrong = self.wrong(value) if serving(self.d) else ["gpud's socket did not answer"]
            if not wrong or time.monotonic() > deadline:
                return wrong
            time.sleep(0.5)

    def under_way(self, limit: float = 60.0) -> bool:
        """Until gpud is changing GPUs (a GPU `applying`) or the state label is `pending`."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self.node.labels().get(MIG_STATE) == "pending":
                return True
            if any(g.get("state") == "applying" for g in _status(self.d).get("gpus", [])):
                return True
            time.sleep(0.05)
        return False

    def other_than(self, rng: random.Random, value: str) -> str:
        return rng.choice([n for n in NAMES if n != value])

    def current(self) -> str:
        return self.node.labels()[MIG_CONFIG]


def _status(d: Daemon) -> dict:
    r = d.ctl("status", "--json")
    return json.loads(r.stdout) if r.returncode == 0 and r.stdout else {}


def _settle_or_fail(r: TrialResult, k: KubeHost, value: str, what: str) -> bool:
    wrong = k.settled(value)
    if wrong:
        r.fail(f"{what}: {value!r} not applied and reported: {wrong}")
    return not wrong


def trial_label_flaps(k: KubeHost, rng: random.Random, tries: int) -> TrialResult:
    r = TrialResult("mig.config flapped", "the label changed several times during an apply: the last value "
                                          "wins, applied whole and reported success; no half state")
    for _ in range(tries):
        r.tries += 1
        value = k.other_than(rng, k.current())
        k.label(value)
        seen = k.under_way()
        for _ in range(rng.randrange(2, 6)):
            value = k.other_than(rng, value)
            k.label(value)
        if _settle_or_fail(r, k, value, "flap"):
            r.outcomes[f"last value won ({'during' if seen else 'after'} an apply)"] += 1
    return r


def trial_configmap_deleted(k: KubeHost, rng: random.Random, tries: int) -> TrialResult:
    r = TrialResult("ConfigMap deleted mid-apply", "the layout's ConfigMap deleted while a label's apply runs: "
                                                   "kept by the kubelet, removed (optional volume) or re-created "
                                                   "with other content; the label's layout as the volume holds it "
                                                   "last is applied whole and reported success")
    ways = ["kept by the kubelet", "removed from the volume", "re-created with other content"]
    for n in range(tries):
        way = ways[n % len(ways)]
        r.tries += 1
        value = k.other_than(rng, k.current())
        k.label(value)
        k.under_way()
        k.delete_configmap()
        if way == "re-created with other content":
            k.put_configmap(1 - k.content)
        k.sync_volume(optional=way == "removed from the volume")
        ok = _settle_or_fail(r, k, value, way)
        if way == "removed from the volume":
            st = _status(k.d)
            errors = (st.get("layout") or {}).get("errors") or []
            if not any("not found" in e for e in errors):
                r.fail(f"{way}: status does not say the file is gone: {errors}")
                ok = False
            k.put_configmap(k.content)  # the operator puts it back
            k.sync_volume()
        elif way == "kept by the kubelet":
            k.put_configmap(k.content)
        if ok:
            r.outcomes[f"{way}: applied whole"] += 1
    return r


def trial_api_outage(k: KubeHost, rng: random.Random, tries: int, seconds: int) -> TrialResult:
    r = TrialResult("API server stopped", f"kube-apiserver stopped mid-apply for {seconds} s: gpud keeps serving; "
                                          "once it is back the state label says success for the label's value, "
                                          "and a later label change is followed")
    for _ in range(tries):
        r.tries += 1
        value = k.other_than(rng, k.current())
        k.label(value)
        k.under_way()
        k.server.stop_apiserver()
        try:
            deadline, answered, looks = time.monotonic() + seconds, 0, 0
            while time.monotonic() < deadline:
                looks += 1
                answered += serving(k.d)
                time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
        finally:
            k.server.start_apiserver()
        if answered < looks:
            r.fail(f"gpud's socket answered {answered} of {looks} looks during the outage")
            continue
        if not _settle_or_fail(r, k, value, "after the outage"):
            continue
        value = k.other_than(rng, value)
        k.label(value)
        if _settle_or_fail(r, k, value, "the change after the outage"):
            r.outcomes[f"served through {seconds} s, then success and the next change followed"] += 1
    return r


def trial_gone_storm(k: KubeHost, rng: random.Random, rounds: int) -> TrialResult:
    r = TrialResult("410 storm", "etcd compacted while every watch expires within 2 s (each re-opened watch is "
                                 "told 410): the label's last value is applied whole and reported success")
    k.proxy.watch_s = 2
    k.proxy.cut()  # gpud's watches open again, each ending within 2 s
    gone_before = k.proxy.gone
    value = k.current()
    try:
        for n in range(rounds):
            r.tries += 1
            if n % 3 == 0:
                value = k.other_than(rng, value)
                k.label(value)
            for i in range(3):  # other objects move etcd's revision past what gpud saw
                k.server.admin("POST", "/api/v1/namespaces/apps/configmaps",
                               {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"generateName": "noise-"},
                                "data": {"i": str(i)}})
            k.server.compact()
            time.sleep(2.5)  # every watch of gpud's ends and is re-opened from a version now compacted
        ok = _settle_or_fail(r, k, value, "after the storm")
    finally:
        k.proxy.watch_s = None
    gone = k.proxy.gone - gone_before
    if gone == 0:
        r.fail("the storm sent no 410: the trial did not test what it says")
    elif ok:
        r.outcomes[f"{rounds} compactions, {gone} 410s sent to gpud: last value applied"] += 1
    return r


def available() -> str | None:
    """None when a real kube-apiserver can run here; else why not."""
    return binaries()[1] or have_openssl()


def run_kube(tmp: Path, rng: random.Random, *, flaps: int, deletions: int, outages: int, outage_s: int,
             storm_rounds: int, only: tuple[str, ...]) -> list[TrialResult]:
    results: list[TrialResult] = []
    k = KubeHost(tmp / "kube")
    try:
        wrong = k.settled("a")
        assert not wrong, f"the first layout did not converge: {wrong}"
        for key, fn, args in (("kube-flap", trial_label_flaps, (flaps,)),
                              ("kube-configmap", trial_configmap_deleted, (deletions,)),
                              ("kube-outage", trial_api_outage, (outages, outage_s)),
                              ("kube-410", trial_gone_storm, (storm_rounds,))):
            if key in only:
                t0 = time.monotonic()
                try:
                    result = fn(k, rng, *args)
                except Exception as e:  # noqa: BLE001 - reported as a crashed trial, never lost
                    result = crashed(key, e)
                result.seconds = time.monotonic() - t0
                results.append(result)
    finally:
        k.close()
    return results
