"""The kubelet's side of DRA against gpud's plugin sockets (the generated gRPC stubs, nothing
hand-made), and the device classes and selectors the DRA tests claim with."""

from __future__ import annotations

from typing import Any, Protocol

from gpud.host.kube import kubelet_plugin
from gpud.plan.dra_slices import DEFAULT_DRIVER

MIG = "mig.gpud.io"
GPU = "gpu.gpud.io"


def profile_is(name: str) -> str:
    return f"device.attributes['{DEFAULT_DRIVER}'].profile == '{name}'"


class PluginSockets(Protocol):
    """Where a DRA plugin serves (gpud's KubeletPlugin, or the paths a test computes for a daemon's)."""

    registration_socket: str
    dra_socket: str


class Kubelet:
    """The kubelet's side of DRA: the generated stubs on gpud's sockets, nothing hand-made."""

    def __init__(self, plugin: PluginSockets) -> None:
        import grpc

        self.v1, self.v1_grpc, _, _, self.reg, self.reg_grpc = kubelet_plugin.proto()
        self.plugin = plugin
        self.dra = grpc.aio.insecure_channel(f"unix://{plugin.dra_socket}")
        self.registration = grpc.aio.insecure_channel(f"unix://{plugin.registration_socket}")

    async def close(self) -> None:
        await self.dra.close()
        await self.registration.close()

    async def register(self):
        stub = self.reg_grpc.RegistrationStub(self.registration)
        info = await stub.GetInfo(self.reg.InfoRequest())
        await stub.NotifyRegistrationStatus(self.reg.RegistrationStatus(plugin_registered=True))
        return info

    async def prepare(self, claim: dict) -> Any:
        """NodePrepareResources for one claim (the API server's object): the plugin's answer for it."""
        return await self._call("NodePrepareResources", claim)

    async def unprepare(self, claim: dict) -> Any:
        return await self._call("NodeUnprepareResources", claim)

    async def _call(self, method: str, claim: dict) -> Any:
        m = claim["metadata"]
        stub = self.v1_grpc.DRAPluginStub(self.dra)
        request = getattr(self.v1, f"{method}Request")(
            claims=[self.v1.Claim(namespace=m["namespace"], uid=m["uid"], name=m["name"])])
        got = await getattr(stub, method)(request)
        return got.claims[m["uid"]]
