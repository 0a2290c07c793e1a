"""A real kube-apiserver and etcd on loopback, for the tests that run gpud's Kubernetes agent
against the server a cluster runs (not an emulator).

The binaries come from scripts/install-kube-apiserver (pinned: kube-apiserver v1.34.12, etcd
v3.6.4, built from the Go module proxy); its status.json names each binary or the exact reason
it could not be built, and the tests skip with that reason. The server runs as a cluster's does
where gpud can tell: TLS with a CA of its own (openssl CLI), `--authorization-mode=Node,RBAC`,
the default admission plugins (ServiceAccount and NamespaceLifecycle included: namespaces and
their `default` ServiceAccount are created here, as kube-controller-manager would), service
account tokens signed by a key of its own, an audit log of every request (Metadata level) so a
test can read what gpud asked and what the server answered. Admin is a static token in
`system:masters`; gpud runs as the ServiceAccount of packaging/kube/gpud-rbac.yaml, applied as
is, with a token from the TokenRequest API (what `kubectl create token` does).

No kube-controller-manager and no kubelet run: tests play the DaemonSet controller and the
kubelet's part of pod deletion themselves (tests/support/kube_cluster.py).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from tests.support.present import present

KUBE_VERSION = "v1.34.12"
REPO = Path(__file__).resolve().parents[2]
RBAC_YAML = REPO / "packaging" / "kube" / "gpud-rbac.yaml"
ADMIN_TOKEN = "admin-token-for-tests"
NAMESPACES = ("gpu-operator", "apps")


def anchor_dir() -> Path:
    return Path(os.environ.get("GPUD_ANCHORS", "/var/cache/gpud-anchors")) / "kube" / KUBE_VERSION


def built(status: Path, names: tuple[str, ...], script: str) -> tuple[dict[str, str], str | None]:
    """({name: path}, None) when every one of `names` is built, as the install script's
    status.json records; else ({}, the reason)."""
    try:
        st = json.loads(status.read_text())
    except FileNotFoundError:
        return {}, f"{status} missing: {script} has not run (make test runs it)"
    except ValueError as e:
        return {}, f"{status} unreadable: {e}"
    out, why = {}, []
    for name in names:
        entry = st.get(name) or {}
        path = entry.get("binary")
        if path and os.access(path, os.X_OK):
            out[name] = path
        else:
            why.append(f"{name}: {entry.get('unavailable') or f'not built ({status})'}")
    return (out, None) if not why else ({}, "; ".join(why))


def binaries() -> tuple[dict[str, str], str | None]:
    """({name: path}, None) when both binaries are there; else ({}, the reason)."""
    return built(anchor_dir() / "status.json", ("kube-apiserver", "etcd"), "scripts/install-kube-apiserver")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _openssl(*args: str, cwd: Path) -> None:
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)}: {r.stderr.strip()}")


def make_certs(d: Path) -> None:
    """A CA, the server's certificate for 127.0.0.1, and the service-account signing key."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "3", "-subj", "/CN=gpud-test-ca", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc\n"
                                  "extendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=kube-apiserver", cwd=d)
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.crt", "-days", "3", "-extfile", "server.ext", cwd=d)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


class RealServer:
    """etcd plus kube-apiserver in `workdir`. `watch_cache=False` serves watches from etcd itself,
    so an etcd compaction reaches a watch that resumes from an older version (410)."""

    def __init__(self, workdir: Path, *, watch_cache: bool = True, bins: dict[str, str] | None = None,
                 extra_args: tuple[str, ...] = ()) -> None:
        if bins is None:
            bins, why = binaries()
            if why:
                raise RuntimeError(why)
        self.bins = bins
        self.dir = Path(workdir)
        self.certs = self.dir / "pki"
        self.watch_cache = watch_cache
        self.extra_args = tuple(extra_args)  # more kube-apiserver flags (a feature gate turned off)
        self.etcd_port, self.peer_port, self.port = free_port(), free_port(), free_port()
        self.etcd: subprocess.Popen | None = None
        self.apiserver: subprocess.Popen | None = None
        self.audit_log = self.dir / "audit.log"
        self._ssl: ssl.SSLContext | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.etcd_port}"

    # --- processes ---------------------------------------------------------------------------
    def start(self) -> RealServer:
        make_certs(self.certs)
        (self.dir / "tokens.csv").write_text(f"{ADMIN_TOKEN},admin,admin-uid,system:masters\n")
        (self.dir / "audit-policy.yaml").write_text(yaml.safe_dump(
            {"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
             "rules": [{"level": "Metadata"}]}))
        self._ssl = ssl.create_default_context(cafile=str(self.certs / "ca.crt"))
        self._start_etcd()
        self.start_apiserver()
        self._bootstrap()
        return self

    def _start_etcd(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        with open(self.dir / "etcd.log", "ab") as log:  # the child has its own descriptor of it
            self.etcd = subprocess.Popen(
                [self.bins["etcd"], "--name", "default", "--data-dir", str(self.dir / "etcd"),
                 "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"default={peer}", "--unsafe-no-fsync", "--log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait(lambda: json.loads(self._http(f"{self.etcd_url}/health")).get("health") == "true",
                   self.etcd, "etcd /health")

    def start_apiserver(self) -> None:
        c = self.certs
        args = [self.bins["kube-apiserver"],
                f"--etcd-servers={self.etcd_url}", "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}", f"--tls-cert-file={c / 'server.crt'}",
                f"--tls-private-key-file={c / 'server.key'}", f"--client-ca-file={c / 'ca.crt'}",
                f"--token-auth-file={self.dir / 'tokens.csv'}", "--authorization-mode=Node,RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={c / 'sa.pub'}", f"--service-account-signing-key-file={c / 'sa.key'}",
                "--service-cluster-ip-range=10.96.0.0/24",
                # as kubeadm and managed clusters run it: node agents (gpud's DaemonSet) are privileged
                "--allow-privileged=true",
                f"--audit-policy-file={self.dir / 'audit-policy.yaml'}", f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json", "--audit-log-mode=blocking",
                "--etcd-compaction-interval=0",  # the tests compact etcd themselves, when they mean to
                f"--cert-dir={self.dir / 'apiserver-certs'}", "--profiling=false",
                f"--watch-cache={'true' if self.watch_cache else 'false'}", *self.extra_args]
        with open(self.dir / "kube-apiserver.log", "ab") as log:
            self.apiserver = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait(lambda: self._http(f"{self.url}/readyz", token=ADMIN_TOKEN) == "ok", self.apiserver,
                   "kube-apiserver /readyz", limit=120)

    def stop_apiserver(self) -> None:
        _stop(self.apiserver)
        self.apiserver = None

    def stop(self) -> None:
        self.stop_apiserver()
        _stop(self.etcd)
        self.etcd = None

    def _wait(self, ready, proc: subprocess.Popen, what: str, limit: float = 60.0) -> None:
        deadline = time.monotonic() + limit
        last = ""
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{what}: exited with {proc.returncode}; log in {self.dir}")
            try:
                if ready():
                    return
            except (OSError, ValueError, urllib.error.URLError) as e:
                last = str(e)
            time.sleep(0.1)
        raise RuntimeError(f"{what} not ready in {limit:.0f}s ({last}); log in {self.dir}")

    # --- HTTP, as the admin ------------------------------------------------------------------
    def _http(self, url: str, body: dict | None = None, *, token: str | None = None, method: str | None = None,
              content_type: str = "application/json") -> str:
        req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), method=method)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        if body is not None:
            req.add_header("Content-Type", content_type)
        with urllib.request.urlopen(req, timeout=10, context=self._ssl if url.startswith("https") else None) as r:
            return r.read().decode()

    def admin(self, method: str, path: str, body: dict | None = None, **kw) -> dict:
        return json.loads(self._http(f"{self.url}{path}", body, token=ADMIN_TOKEN, method=method, **kw) or "{}")

    def _create(self, path: str, obj: dict) -> None:
        try:
            self.admin("POST", path, obj)
        except urllib.error.HTTPError as e:
            if e.code != 409:  # AlreadyExists
                raise RuntimeError(f"POST {path}: {e.code} {e.read().decode()[:300]}") from None

    def _bootstrap(self) -> None:
        """What a cluster has before gpud joins: the operator's namespaces with their `default`
        ServiceAccount (kube-controller-manager's job), and gpud's RBAC applied as documented."""
        self._wait(lambda: self.admin("GET", "/api/v1/namespaces/kube-system")["metadata"]["name"] == "kube-system",
                   present(self.apiserver, "a running kube-apiserver"), "namespace kube-system")
        for ns in NAMESPACES:
            self._create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        for ns in (*NAMESPACES, "default"):
            self._create(f"/api/v1/namespaces/{ns}/serviceaccounts",
                         {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})
        self.apply_yaml(RBAC_YAML.read_text())

    def apply_yaml(self, text: str) -> None:
        for doc in yaml.safe_load_all(text):
            if doc:
                self._create(_collection(doc), doc)

    def token(self, namespace: str, service_account: str) -> str:
        """A token for the ServiceAccount (TokenRequest, as `kubectl create token` asks for one)."""
        st = self.admin("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token",
                        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                         "spec": {"expirationSeconds": 86400}})
        return st["status"]["token"]

    def kubeconfig(self, path: Path, *, token: str | None = None, user: str = "gpud") -> str:
        """A kubeconfig for gpud's ServiceAccount (or for the given token)."""
        token = token or self.token("kube-system", "gpud")
        ca = base64.b64encode((self.certs / "ca.crt").read_bytes()).decode()
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "real", "cluster": {"server": self.url, "certificate-authority-data": ca}}],
            "contexts": [{"name": "test", "context": {"cluster": "real", "user": user}}],
            "users": [{"name": user, "user": {"token": token}}],
        }))
        return str(path)

    def admin_kubeconfig(self, path: Path) -> str:
        return self.kubeconfig(path, token=ADMIN_TOKEN, user="admin")

    # --- etcd ---------------------------------------------------------------------------------
    def etcd_revision(self) -> int:
        body = {"key": base64.b64encode(b"/registry").decode()}
        return int(json.loads(self._http(f"{self.etcd_url}/v3/kv/range", body))["header"]["revision"])

    def compact(self) -> int:
        """Compact etcd's history up to its current revision (the v3 KV Compact call, through
        etcd's gRPC gateway); returns that revision. Watches from older versions then get 410."""
        rev = self.etcd_revision()
        self._http(f"{self.etcd_url}/v3/kv/compaction", {"revision": str(rev), "physical": True})
        return rev

    # --- the audit log -----------------------------------------------------------------------
    def audit(self, username: str) -> list[dict]:
        """Every request `username` made, as the server recorded it (stage ResponseComplete,
        or ResponseStarted for a watch), with the response's status code."""
        out: list[dict] = []
        if not self.audit_log.exists():
            return out
        text = self.audit_log.read_text()
        # the server may be writing its last line now: only whole (newline-ended) lines count
        for line in text[:text.rfind("\n") + 1].splitlines():
            ev = json.loads(line)
            if ev.get("user", {}).get("username") == username and ev.get("stage") in ("ResponseComplete",
                                                                                       "ResponseStarted"):
                out.append(ev)
        return out



def narrowed_role(server: RealServer, kubeconfig: Path, name: str, rules) -> str:
    """The documented role (packaging/kube/gpud-rbac.yaml) with its rules passed through `rules`,
    applied under `name` and bound to an identity of its own: `kubeconfig` is written for it."""
    docs = [d for d in yaml.safe_load_all(RBAC_YAML.read_text()) if d]
    for d in docs:
        d["metadata"]["name"] = name
        if d["kind"] == "ClusterRole":
            d["rules"] = rules(d["rules"])
        if d["kind"] == "ClusterRoleBinding":
            d["roleRef"]["name"] = name
            d["subjects"][0]["name"] = name
    server.apply_yaml(yaml.safe_dump_all(docs))
    return server.kubeconfig(kubeconfig, token=server.token("kube-system", name))

def _collection(doc: dict) -> str:
    """The API path that creates `doc` (the few kinds the RBAC file and the tests use)."""
    kind, ns = doc["kind"], doc.get("metadata", {}).get("namespace")
    paths = {"ServiceAccount": f"/api/v1/namespaces/{ns}/serviceaccounts",
             "Namespace": "/api/v1/namespaces",
             "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
             "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
             "Role": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
             "RoleBinding": f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings"}
    if kind not in paths:
        raise ValueError(f"no API path known for kind {kind}")
    return paths[kind]


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def have_openssl() -> str | None:
    return None if shutil.which("openssl") else "the openssl CLI is needed to make the test server's certificates"
