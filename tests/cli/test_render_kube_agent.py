"""`gpudctl status --kube`: a refused or unreachable API server is said as the server said it."""

from __future__ import annotations

from gpud.cli.render import render_kubernetes
from gpud.wire import replies as wire_replies


def _render(**agent) -> str:
    return render_kubernetes(wire_replies.KubernetesStatus(advertised=wire_replies.Advertised(),
                                                           agent=wire_replies.KubeAgentStatus(node="gpu-1", **agent)))


def test_a_refusal_names_the_missing_verb():
    msg = ('Kubernetes API: 403 Forbidden: nodes "gpu-1" is forbidden: User "system:serviceaccount:kube-system:gpud" '
           'cannot patch resource "nodes" in API group "" at the cluster scope')
    assert f"node gpu-1: {msg}" in _render(message=msg).splitlines()


def test_unreachable_and_connected():
    assert "node gpu-1: API server NOT REACHABLE" in _render().splitlines()
    assert "node gpu-1: API server connected" in _render(connected=True).splitlines()
