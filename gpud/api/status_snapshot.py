"""The `status` reply, built once per view and answered from memory.

Fifty clients asking many times a second must not each rebuild the same reply: the engine hands
out the same EngineView object while nothing in it changed (gpud.engine.view), so the reply is
rebuilt only for a new view; only its age is new in each answer.

The server sends it already encoded (`encoded`): MessagePack writes a struct as a map of its
fields in declaration order, each value encoded as it would be alone, so the fields that are the
same for every answer (at 64 GPUs with 7 MIG devices each, 80 KB of the 82 KB) are encoded once
per snapshot and only the answer's time, age and Kubernetes part are encoded per request. The
bytes are those msgspec writes for the whole struct (tests/api/test_status_encoded.py).
"""

from __future__ import annotations

from typing import Any

import msgspec

from gpud.api import replies
from gpud.engine.gpu_state import GpuState
from gpud.engine.view import EngineView
from gpud.layout.desired import DesiredGpu
from gpud.model import Gpu
from gpud.plan.node_labels import Advertised, advertised
from gpud.wire import replies as wire_replies

_encode = msgspec.msgpack.Encoder().encode
# encoded per answer; every other field of StatusReply once per snapshot
PER_ANSWER = ("observed_at", "observation_age", "kubernetes")
_FIELDS = msgspec.structs.fields(wire_replies.StatusReply)


def _map_header(n: int) -> bytes:
    """MessagePack's header of a map of `n` entries (the format's spec: fixmap, map 16, map 32)."""
    if n < 16:
        return bytes([0x80 | n])
    return b"\xde" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdf" + n.to_bytes(4, "big")


class _Encoded:
    """A reply's bytes split around its per-answer fields: `parts[i]` (up to and with the field's
    name) precede the value of the i-th per-answer field in declaration order, `tail` follows."""

    __slots__ = ("reply", "names", "parts", "tail")

    def __init__(self, reply: wire_replies.StatusReply) -> None:
        self.reply = reply
        chunks = [_map_header(len(_FIELDS))]
        self.names: list[str] = []
        self.parts: list[bytes] = []
        for f in _FIELDS:
            chunks.append(_encode(f.encode_name))
            if f.name in PER_ANSWER:
                self.names.append(f.name)
                self.parts.append(b"".join(chunks))
                chunks = []
            else:
                chunks.append(_encode(getattr(reply, f.name)))
        self.tail = b"".join(chunks)

    def answer(self, values: dict[str, Any]) -> bytes:
        out: list[bytes] = []
        for name, part in zip(self.names, self.parts, strict=True):
            out += (part, _encode(values[name]))
        out.append(self.tail)
        return b"".join(out)


class StatusSnapshot:
    def __init__(self) -> None:
        self._view: EngineView | None = None
        self._reply: wire_replies.StatusReply | None = None
        self.builds = 0  # replies built (not reused): for tests and the stats op
        self._advertised: tuple[tuple[Gpu, ...], str, Advertised] | None = None
        self._gpus: dict[str, tuple[Any, ...]] = {}  # PCI address -> (inputs..., its GpuStatus)
        self._encoded: _Encoded | None = None

    def advertised(self, gpus: tuple[Gpu, ...], mig_strategy: str) -> Advertised:
        """What the device plugins advertise for these GPUs, worked out once per observation (each
        answer costs a pass over every GPU and MIG device otherwise: 64 GPUs x 7 under 50 clients)."""
        kept = self._advertised
        if kept is None or kept[0] is not gpus or kept[1] != mig_strategy:
            kept = self._advertised = (gpus, mig_strategy, advertised(gpus, mig_strategy=mig_strategy))
        return kept[2]

    def _gpu_status(self, gpu: Gpu, desired: DesiredGpu | None, state: GpuState | None, rebuilt: list[str] | None,
                    leases: list[Any], lease_free: Any) -> wire_replies.GpuStatus:
        """replies.gpu_status, kept per GPU while its inputs stay the same: during an apply each
        step's re-read makes a new view, and rebuilding every GPU's answer for it held the loop
        3 ms at 64 GPUs. The observer keeps an unchanged GPU's record as the same object
        (discovery.keep_unchanged); its desired entry comes from a new resolution after each re-read,
        so it is compared by value. A GPU with leases is built afresh (its answer carries their ages)."""
        kept = self._gpus.get(gpu.pci)
        if (kept is not None and not leases and kept[0] is gpu and kept[1] == desired and kept[2] == state
                and kept[3] == rebuilt and kept[4] == lease_free):
            return kept[5]
        out = replies.gpu_status(gpu, desired, state, rebuilt, leases, lease_free)
        self._gpus[gpu.pci] = (gpu, desired, state, rebuilt, lease_free, out)
        return out

    def _current(self, view: EngineView) -> wire_replies.StatusReply:
        if self._reply is None or view is not self._view:
            present = {g.pci for g in view.observation.gpus}
            for pci in [p for p in self._gpus if p not in present]:
                del self._gpus[pci]
            self._reply = replies.status_reply(view, status_of=self._gpu_status)
            self._view = view
            self.builds += 1
        return self._reply

    def reply(self, view: EngineView, *, observed_at: float, age: float,
              kubernetes: wire_replies.KubernetesStatus | None = None) -> wire_replies.StatusReply:
        """The reply as of now: the snapshot, stamped with the observation's time and age, and
        `kubernetes` (what the device plugins advertise, the label protocol's state) as of now."""
        return msgspec.structs.replace(self._current(view), **_per_answer(observed_at, age, kubernetes))

    def encoded(self, view: EngineView, *, observed_at: float, age: float,
                kubernetes: wire_replies.KubernetesStatus | None = None) -> msgspec.Raw:
        """`reply(...)` as MessagePack: the bytes msgspec writes for it, the snapshot's own fields
        encoded once per snapshot."""
        return msgspec.Raw(self.parts(view).answer(_per_answer(observed_at, age, kubernetes)))

    def parts(self, view: EngineView) -> _Encoded:
        """The snapshot of `view` encoded around its per-answer fields: the same object while the
        snapshot stays (what the status replica is sent, gpud.api.status_feed)."""
        current = self._current(view)
        enc = self._encoded
        if enc is None or enc.reply is not current:
            enc = self._encoded = _Encoded(current)
        return enc


def _per_answer(observed_at: float, age: float, kubernetes: wire_replies.KubernetesStatus | None) -> dict[str, Any]:
    return {"observed_at": round(observed_at, 3), "observation_age": round(age, 4), "kubernetes": kubernetes}
