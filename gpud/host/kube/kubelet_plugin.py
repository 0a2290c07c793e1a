"""gpud as a kubelet DRA plugin: the two gRPC services the kubelet talks to, over Unix sockets.

* Registration (`pluginregistration.Registration`, k8s.io/kubelet pkg/apis/pluginregistration/v1):
  a socket in the kubelet's plugin registry (`<root>/plugins_registry/<driver>-reg.sock`); the
  kubelet's plugin watcher finds it, asks GetInfo (type `DRAPlugin`, the driver name, the DRA
  socket, the services served) and reports with NotifyRegistrationStatus.
* DRA (`k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin` and its v1beta1 twin, same messages): the
  kubelet calls NodePrepareResources before a pod's containers start and NodeUnprepareResources
  after they are gone. A kubelet of 1.34-1.36 picks the first of `v1.DRAPlugin`,
  `v1beta1.DRAPlugin` it supports (pkg/kubelet/cm/dra/plugin/dra_plugin.go).

The messages are the generated code of scripts/gen-dra-proto (gpud.kube_proto); what prepare
does is the `Handler`'s business (gpud.engine.dra).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from msgspec import Struct

DEFAULT_ROOT = "/var/lib/kubelet"
SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
MAX_SOCKET_PATH = 107  # sockaddr_un.sun_path: 108 bytes with the terminating NUL (unix(7))


class ProtoMissing(RuntimeError):
    """The generated gRPC code is not there (scripts/gen-dra-proto has not run, or failed)."""


def proto() -> tuple[Any, Any, Any, Any, Any, Any]:
    """(dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc, reg_pb2, reg_pb2_grpc)."""
    try:
        from gpud.kube_proto import (
            dra_v1_pb2,
            dra_v1_pb2_grpc,
            dra_v1beta1_pb2,
            dra_v1beta1_pb2_grpc,
            pluginregistration_v1_pb2,
            pluginregistration_v1_pb2_grpc,
        )
    except ImportError as e:
        why = Path(__file__).resolve().parents[1] / "kube_proto" / "UNAVAILABLE"
        detail = why.read_text().strip() if why.exists() else str(e)
        raise ProtoMissing(f"the kubelet's DRA gRPC code is not generated (scripts/gen-dra-proto): {detail}") from e
    return (dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc, pluginregistration_v1_pb2,
            pluginregistration_v1_pb2_grpc)


class ClaimRef(Struct, frozen=True):
    namespace: str
    uid: str
    name: str


class PreparedDevice(Struct, frozen=True):
    requests: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    share_id: str | None = None


class Prepared(Struct, frozen=True):
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class Handler(Protocol):
    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, Prepared]: ...
    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]: ...  # uid -> error ("" = done)


def paths(root: str, driver: str) -> tuple[str, str]:
    """(registration socket, DRA socket) under the kubelet's root directory."""
    return (os.path.join(root, "plugins_registry", f"{driver}-reg.sock"),
            os.path.join(root, "plugins", driver, "dra.sock"))


class KubeletPlugin:
    """Both servers; `registered` is what the kubelet last said (None: it has not called yet)."""

    def __init__(self, driver: str, handler: Handler, *, root: str = DEFAULT_ROOT) -> None:
        self.driver, self.handler, self.root = driver, handler, root
        self.registration_socket, self.dra_socket = paths(root, driver)
        self.registered: bool | None = None
        self.registration_error = ""
        self._servers: list[Any] = []

    async def start(self) -> None:
        import grpc

        v1, v1_grpc, b1, b1_grpc, reg, reg_grpc = proto()
        plugin = self

        def claims(request: Any) -> list[ClaimRef]:
            return [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]

        def servicer(pb: Any, base: type) -> Any:
            class Dra(base):
                async def NodePrepareResources(self, request: Any, context: Any) -> Any:
                    got = await plugin.handler.prepare(claims(request))
                    out = pb.NodePrepareResourcesResponse()
                    for uid, p in got.items():
                        r = out.claims[uid]
                        r.error = p.error
                        for d in p.devices:
                            dev = r.devices.add(request_names=list(d.requests), pool_name=d.pool,
                                                device_name=d.device, cdi_device_ids=list(d.cdi_ids))
                            if d.share_id is not None:
                                dev.share_id = d.share_id
                    return out

                async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
                    got = await plugin.handler.unprepare(claims(request))
                    out = pb.NodeUnprepareResourcesResponse()
                    for uid, error in got.items():
                        out.claims[uid].error = error
                    return out
            return Dra()

        class Registration(reg_grpc.RegistrationServicer):  # type: ignore[name-defined]
            async def GetInfo(self, request: Any, context: Any) -> Any:
                return reg.PluginInfo(type="DRAPlugin", name=plugin.driver, endpoint=plugin.dra_socket,
                                      supported_versions=list(SERVICES))

            async def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
                plugin.registered = request.plugin_registered
                plugin.registration_error = request.error
                return reg.RegistrationStatusResponse()

        for path in (self.registration_socket, self.dra_socket):
            if len(os.fsencode(path)) > MAX_SOCKET_PATH:  # grpc only says the bind failed
                raise OSError(errno.ENAMETOOLONG, f"{path}: a Unix socket path has at most {MAX_SOCKET_PATH} "
                              "bytes (unix(7)); choose a shorter --kubelet-root")
        for path in (self.registration_socket, self.dra_socket):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a socket left by a gpud that was killed
        dra = grpc.aio.server()
        v1_grpc.add_DRAPluginServicer_to_server(servicer(v1, v1_grpc.DRAPluginServicer), dra)
        b1_grpc.add_DRAPluginServicer_to_server(servicer(b1, b1_grpc.DRAPluginServicer), dra)
        dra.add_insecure_port(f"unix://{self.dra_socket}")
        await dra.start()
        try:
            registration = grpc.aio.server()
            reg_grpc.add_RegistrationServicer_to_server(Registration(), registration)
            # last: the kubelet's watcher acts on the socket's appearance, when the DRA socket is served
            registration.add_insecure_port(f"unix://{self.registration_socket}")
            await registration.start()
        except BaseException:
            await dra.stop(grace=None)  # no server left running without its registration
            raise
        self._servers = [registration, dra]

    async def stop(self) -> None:
        for server in self._servers:
            await server.stop(grace=1.0)
        self._servers = []
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.registration_socket)  # the kubelet deregisters the plugin when it goes


def other_plugin_registered(root: str, driver: str, own: str) -> str | None:
    """The registration socket of another kubelet plugin for `driver` (NVIDIA's DRA plugin when
    gpud publishes as gpu.nvidia.com), or None. NVIDIA's kubelet plugin registers as
    `<root>/plugins_registry/gpu.nvidia.com-reg.sock` (k8s.io/dynamic-resource-allocation
    kubeletplugin's default name), `<driver>-<uid>-reg.sock` with rolling updates: any socket of
    that driver's name counts, and gpud's own path too while something listens on it (gpud has
    not started serving: the listener is another plugin, which a start would unlink and take
    over). A socket there that nothing listens on is one a killed gpud left."""
    reg_dir = os.path.join(root, "plugins_registry")
    try:
        names = os.listdir(reg_dir)
    except FileNotFoundError:
        return None
    for name in sorted(names):
        path = os.path.join(reg_dir, name)
        if not (name.startswith(driver) and name.endswith(".sock")):
            continue
        if path != own or _listening(path):
            return path
    return None


def _listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        try:
            s.connect(path)
        except OSError:
            return False
    return True
