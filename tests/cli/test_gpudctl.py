"""gpudctl as a user runs it: a subprocess against a fake gpud on a real socket."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from gpud.api.server import ApiError
from gpud.cli import render
from gpud.wire import protocol as wire
from gpud.wire import replies as wire_replies
from tests.api.fakes import GPU0_UUID, MIG_UUIDS, ThreadedServer
from tests.support.present import present
from tests.support.processes import reap

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "h200"


def run(srv_or_path, *args: str, env: dict | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    path = srv_or_path.path if isinstance(srv_or_path, ThreadedServer) else srv_or_path
    cmd = [sys.executable, "-m", "gpud.cli.gpudctl", *(["--socket", path] if path else []), *args]
    # the width is the test's to choose: not the terminal's the run inherited (pytest-xdist's
    # workers have COLUMNS set), so piped output is the wide page unless `env` says otherwise
    inherited = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    full_env = {**inherited, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO, env=full_env, input=stdin)


def calls(srv, op):
    return [args for o, args, _ in srv.handler.calls if o == op]


def test_status_table(daemon):
    r = run(daemon, "status")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "gpud 0.1.0: waiting"
    header = lines[2].split()
    assert header == ["GPU", "PCI", "MODEL", "DRIVER", "WORKLOAD", "MIG", "INSTANCES", "STATE"]
    row0, row1, row2 = lines[3], lines[4], lines[5]
    assert row0.split()[:2] == ["0", "0000:3b:00.0"]
    assert "NVIDIA H200" in row0 and " on " in row0
    assert "4x1g.18gb 1x3g.71gb" in row0 and row0.endswith("converged")
    assert "vm-passthrough" in row1 and " off " in row1 and row1.endswith("waiting: pid 4121 python")
    assert "vfio-pci" in row2 and row2.split()[6:8] == ["-", "-"]  # no MIG mode/instances on vfio-pci
    # columns line up: every row's STATE starts where the header's does
    col = lines[2].index("STATE")
    assert all(line[col - 2:col] == "  " and line[col] != " " for line in lines[3:6])
    assert "layout: /etc/gpud/layout.yaml  selected: partial-mig  valid" in lines
    assert "  warning: /etc/gpud/layout.yaml:9 layouts.partial-mig[1]: matches no GPU" in lines
    i = lines.index("MIG devices:")
    assert lines[i + 1] == f"GPU 0: NVIDIA H200 (UUID: {GPU0_UUID})"
    assert lines[i + 2] == f"  MIG 3g.71gb      Device  0: (UUID: {MIG_UUIDS[0]})"
    assert lines[i + 3] == f"  MIG 1g.18gb      Device  1: (UUID: {MIG_UUIDS[3]})"
    assert len(lines) == i + 7  # 5 MIG devices of GPU 0 only


def test_status_json_shape(daemon):
    r = run(daemon, "status", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"phase", "layout", "gpus", "read_only", "version", "observed_at", "observation_age",
                        "kubernetes", "rebuilt_after_boot", "state_files"}
    g0 = doc["gpus"][0]
    assert {"index", "pci", "uuid", "model", "pci_id", "driver", "workload", "iommu_group", "numa_node", "mig",
            "converged", "state", "message", "holders", "group", "vfio_device", "vgpu", "dynamic", "leases",
            "lease_free"} == set(g0)
    assert g0["mig"]["instances"][0] == {"profile": "1g.18gb", "placement": {"start": 4, "size": 1}, "gi": 11,
                                         "ci": 0, "uuid": MIG_UUIDS[4], "holders": [], "ci_placement": None}
    assert g0["group"][0]["class"] == "0x030200"
    assert doc["gpus"][1]["holders"] == [{"pid": 4121, "name": "python", "device": "/dev/nvidia1", "vm": None}]


def test_socket_from_environment(daemon):
    r = run(None, "version", env={"GPUD_SOCKET": daemon.path})
    assert r.returncode == 0, r.stderr
    assert "gpud    0.1.0 (protocol 1)" in r.stdout and "driver  550.90.07" in r.stdout


def test_check_sends_the_file_and_reports_validity(daemon, tmp_path):
    f = tmp_path / "layout.yaml"
    f.write_text("version: v1\n")
    r = run(daemon, "check", str(f))
    assert (r.returncode, r.stdout.strip()) == (0, f"{f}: valid (selected: partial-mig)")
    assert calls(daemon, "check") == [{"text": "version: v1\n", "path": str(f), "all_layouts": False}]
    daemon.handler.replies["check"] = wire_replies.CheckReply(valid=False, errors=[f"{f}:1 version: must be v1"],
                                                              warnings=["w"])
    r = run(daemon, "check", str(f))
    assert r.returncode == 4
    assert r.stdout.splitlines() == [f"{f}: INVALID", f"error: {f}:1 version: must be v1", "warning: w"]
    r = run(daemon, "check", "-", stdin="layouts: {}\n")
    assert calls(daemon, "check")[-1] == {"text": "layouts: {}\n", "path": "<stdin>", "all_layouts": False}


def test_check_of_a_missing_file_fails_locally(daemon, tmp_path):
    r = run(daemon, "check", str(tmp_path / "nope.yaml"))
    assert r.returncode == 1
    assert r.stderr.startswith(f"gpudctl: cannot read {tmp_path / 'nope.yaml'}: No such file")
    assert calls(daemon, "check") == []


def test_plan_output_and_exit_codes(daemon, tmp_path):
    r = run(daemon, "plan")
    assert r.returncode == 0, r.stderr
    assert calls(daemon, "plan") == [{"text": None, "path": None}]  # the loaded layout
    out = r.stdout.splitlines()
    assert out[0] == "GPU 0 0000:3b:00.0: 4 steps (destroy-ci, destroy-gi, create-gi, create-ci)"
    assert out[1] == f"  1. destroy-ci 1g.18gb@6:1 gi 13 ci 0 {MIG_UUIDS[6]}"  # single-spaced
    assert "  3. create-gi 1g.35gb@6:2" in out
    assert "  1. set-mig-mode on" in out and "  2. reset" in out
    assert "GPU 2 0000:9a:00.0: nothing to do" in out
    assert (f"  destroys 1g.18gb {{6}}:1 on 0000:3b:00.0 {MIG_UUIDS[6]} held by pid 31337 jupyter") in out
    assert "  MIG mode changes: 0000:5c:00.0" in out and "  GPU resets: 0000:5c:00.0" in out

    f = tmp_path / "l.yaml"
    f.write_text("x: 1\n")
    daemon.handler.replies["plan"] = wire_replies.PlanReply(gpus=[wire_replies.GpuPlanInfo(
        index=0, pci="0000:3b:00.0", infeasible="4x 2g.35gb need 8 slices, the GPU has 7",
        blocked_by=[wire_replies.HolderInfo(pid=9, name="vllm", device="/dev/nvidia0")])])
    r = run(daemon, "plan", str(f))
    assert r.returncode == 4
    assert calls(daemon, "plan")[-1] == {"text": "x: 1\n", "path": str(f)}
    assert "GPU 0 0000:3b:00.0: INFEASIBLE: 4x 2g.35gb need 8 slices, the GPU has 7" in r.stdout
    assert "  blocked by: pid 9 vllm (/dev/nvidia0)" in r.stdout
    assert "disruption: none" in r.stdout
    daemon.handler.replies["plan"] = wire_replies.PlanReply(errors=["layout.yaml:2 layouts: unknown key"])
    r = run(daemon, "plan", "--json")
    assert r.returncode == 4 and json.loads(r.stdout)["errors"] == ["layout.yaml:2 layouts: unknown key"]


def test_apply_exit_codes(daemon):
    r = run(daemon, "apply")
    assert r.returncode == 0 and calls(daemon, "apply")[-1] == {"wait": False, "timeout": None}
    r = run(daemon, "apply", "--wait", "--timeout", "90")
    assert r.returncode == 0 and calls(daemon, "apply")[-1] == {"wait": True, "timeout": 90.0}
    assert r.stdout.startswith("apply: converged: all GPUs converged")
    daemon.handler.replies["apply"] = wire_replies.ApplyReply(
        phase="waiting", converged=False, message="1 GPU waiting",
        gpus=[wire_replies.GpuApplyInfo(pci="0000:5c:00.0", state="waiting", message="pid 4121 python holds /dev/nvidia1")])
    r = run(daemon, "apply", "--wait")
    assert r.returncode == 5
    assert "  0000:5c:00.0  waiting: pid 4121 python holds /dev/nvidia1" in r.stdout
    assert run(daemon, "apply").returncode == 0  # without --wait, started is success
    daemon.handler.errors["apply"] = ApiError("timeout", "not converged after 90 s")
    r = run(daemon, "apply", "--wait", "--timeout", "90")
    assert r.returncode == 5 and "not converged after 90 s" in r.stderr
    daemon.handler.errors["apply"] = ApiError("forbidden", "apply needs root")
    r = run(daemon, "apply")
    assert r.returncode == 1 and r.stderr == "gpudctl: apply needs root [forbidden]\n"


def test_reload(daemon):
    r = run(daemon, "reload")
    assert r.returncode == 0 and r.stdout.startswith("reloaded /etc/gpud/layout.yaml: valid")
    daemon.handler.replies["reload"] = wire_replies.LayoutStatus(path="/etc/gpud/layout.yaml", errors=["bad"])
    r = run(daemon, "reload")
    assert r.returncode == 4 and "error: bad" in r.stdout
    daemon.handler.errors["reload"] = ApiError("read-only", "read-only mode")
    assert run(daemon, "reload").returncode == 1


def test_mig_profiles_look_like_nvidia_smi(daemon):
    r = run(daemon, "mig", "profiles", "--gpu", "0000:3b:00.0")
    assert r.returncode == 0, r.stderr
    expected = (FIXTURES / "nvidia-smi-mig-lgip.txt").read_text() + (FIXTURES / "nvidia-smi-mig-lgipp.txt").read_text()
    assert r.stdout == expected
    assert calls(daemon, "mig-profiles") == [{"gpu": "0000:3b:00.0"}]
    run(daemon, "mig", "profiles")
    assert calls(daemon, "mig-profiles")[-1] == {"gpu": None}


def test_passthrough(daemon):
    r = run(daemon, "passthrough")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["PCI", "ID", "IOMMU", "VFIO", "NUMA", "RESOURCE"]
    assert lines[1].split() == ["0000:9a:00.0", "10de:2335", "88", "/dev/vfio/88", "1", "nvidia.com/GH100_H200_SXM_141GB"]
    assert "      <address domain='0x0000' bus='0x9a' slot='0x00' function='0x0'/>" in lines
    doc = json.loads(run(daemon, "passthrough", "--json").stdout)
    assert doc["devices"][0]["kubevirt"]["pciVendorSelector"] == "10DE:2335"


def test_events_history(daemon):
    daemon.call(daemon.handler.publish, "step", "created 1g.18gb", "0000:3b:00.0")
    r = run(daemon, "events")
    assert r.returncode == 0
    assert r.stdout.rstrip().endswith("step 0000:3b:00.0: created 1g.18gb")
    line = json.loads(run(daemon, "events", "--json").stdout)
    assert (line["kind"], line["gpu"]) == ("step", "0000:3b:00.0")


def test_events_follow_until_interrupted(daemon):
    daemon.call(daemon.handler.publish, "layout", "loaded")
    proc = subprocess.Popen([sys.executable, "-m", "gpud.cli.gpudctl", "--socket", daemon.path, "events", "-f"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)},
                            # a test run started in the background (`make test &`) inherits SIGINT
                            # ignored, and Python then never turns it into KeyboardInterrupt
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert present(proc.stdout).readline().rstrip().endswith("layout: loaded")  # history: now subscribed
        daemon.call(daemon.handler.publish, "wait", "pid 4121 python holds /dev/nvidia1", "0000:5c:00.0")
        assert present(proc.stdout).readline().rstrip().endswith("wait 0000:5c:00.0: pid 4121 python holds /dev/nvidia1")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        reap(proc)


def test_events_follow_ends_with_3_when_the_daemon_goes(tmp_path):
    srv = ThreadedServer(group=None).start()
    proc = subprocess.Popen([sys.executable, "-m", "gpud.cli.gpudctl", "--socket", srv.path, "events", "-f"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        srv.call(srv.handler.publish, "layout", "loaded")
        # wait until the client is following (its history line is printed), then stop the daemon
        assert present(proc.stdout).readline().rstrip().endswith("layout: loaded")
        srv.stop()
        assert proc.wait(30) == 3
        assert "closed the connection" in present(proc.stderr).read()
    finally:
        reap(proc)


def test_usage_errors_exit_2(daemon):
    assert run(daemon, "frobnicate").returncode == 2
    assert run(daemon).returncode == 2
    assert run(daemon, "mig").returncode == 2
    r = run(daemon, "apply", "--timeout", "5")
    assert r.returncode == 2 and "--timeout needs --wait" in r.stderr
    assert run(daemon, "--help").returncode == 0


def test_unreachable_daemon_exits_3(tmp_path):
    path = str(tmp_path / "gpud.sock")
    r = run(path, "status")
    assert r.returncode == 3
    assert r.stderr == f"gpudctl: cannot reach gpud at {path}: No such file or directory (is gpud running?)\n"
    assert r.stdout == ""
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(path)
    dead.close()  # socket file of a daemon that died
    r = run(path, "version")
    assert r.returncode == 3 and "Connection refused" in r.stderr


def test_daemon_hanging_up_without_answer_exits_3(tmp_path):
    path = str(tmp_path / "s")
    lsock = socket.socket(socket.AF_UNIX)
    lsock.bind(path)
    lsock.listen()

    def accept_and_close():
        conn, _ = lsock.accept()
        conn.recv(65536)
        conn.close()

    t = threading.Thread(target=accept_and_close, daemon=True)
    t.start()
    r = run(path, "status")
    t.join(30)
    lsock.close()
    assert r.returncode == 3 and "closed the connection" in r.stderr


def test_a_daemon_that_took_the_request_but_has_not_answered_exits_6(tmp_path):
    """Connected and asked, no answer within --reply-timeout: gpud is working, not unreachable (3)."""
    path = str(tmp_path / "s")
    lsock = socket.socket(socket.AF_UNIX)
    lsock.bind(path)
    lsock.listen()
    taken = threading.Event()

    def accept_and_keep_quiet():
        conn, _ = lsock.accept()
        conn.recv(65536)
        taken.set()
        release.wait(30)
        conn.close()

    release = threading.Event()
    t = threading.Thread(target=accept_and_keep_quiet, daemon=True)
    t.start()
    try:
        layout_file = tmp_path / "many.yaml"
        layout_file.write_text("version: v1\nlayouts: {a: [], b: []}\n")
        r = run(path, "--reply-timeout", "0.5", "check", "--all-layouts", str(layout_file))
    finally:
        release.set()
        t.join(30)
        lsock.close()
    assert taken.is_set()
    assert r.returncode == 6 and "did not answer within 0.5 s" in r.stderr
    assert run(path, "--reply-timeout", "0", "status").returncode == 2


CLI_MODULES = sorted(f"gpud.cli.{p.stem}" for p in (REPO / "gpud" / "cli").glob("*.py") if p.stem != "__init__")


def test_client_imports_nothing_heavy():
    """Every module of the client package, imported in a fresh interpreter, pulls in no heavy
    dependency, not msgspec (the client reads the wire with msgpack: gpud.cli.view), and of gpud
    itself only the package markers, the msgspec-free part of the protocol (gpud.wire.frames) and
    the standard-library module of MIG words (gpud.mig_text)."""
    assert {"gpud.cli.gpudctl", "gpud.cli.transport", "gpud.cli.render", "gpud.cli.commands"} <= set(CLI_MODULES)
    banned = ["pynvml", "yaml", "pyudev", "dbus_fast", "asyncinotify", "prometheus_client", "asyncio", "msgspec"]
    allowed = ["gpud", "gpud.wire", "gpud.wire.frames", "gpud.mig_text", "gpud.cli", *CLI_MODULES]
    code = ("import importlib, sys, json\n"
            f"for name in {CLI_MODULES!r}: importlib.import_module(name)\n"
            f"print(json.dumps([m for m in sys.modules if m in {banned!r} "
            f"or (m.split('.')[0] == 'gpud' and m not in {allowed!r})]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
    assert json.loads(out) == []


def test_state_and_mig_columns():
    g = wire_replies.GpuStatus(index=0, pci="p", state="failed", message="NVML_ERROR_IN_USE creating 3g.71gb",
                               mig=wire_replies.MigStatus(capable=True, mode="disabled", pending="enabled"))
    assert render.state_column(g) == "failed: NVML_ERROR_IN_USE creating 3g.71gb"
    assert render.mig_column(g.mig) == "pending(on)"
    assert render.mig_column(wire_replies.MigStatus()) == "-"
    many = wire_replies.GpuStatus(index=0, pci="p", state="waiting", holders=[
        wire_replies.HolderInfo(pid=1, name="a"), wire_replies.HolderInfo(pid=2, name="b")])
    assert render.state_column(many) == "waiting: pid 1 a (+1 more)"


def test_check_of_a_binary_file_fails_locally(daemon, tmp_path):
    f = tmp_path / "layout.yaml"
    f.write_bytes(b"\xff\xfe\x00")
    r = run(daemon, "check", str(f))
    assert r.returncode == 1 and "not UTF-8" in r.stderr and "Traceback" not in r.stderr


LONG = ("1 x 4g.40gb + 2 x 3g.40gb needs 12 of 8 memory slices on NVIDIA H100 80GB HBM3 0000:5c:00.0; "
        "the layout cannot be applied to this GPU as written, change the entry that selects it")


def test_status_table_fits_the_terminal_and_the_detail_view_has_it_whole(daemon):
    reply = daemon.handler.replies["status"]
    reply.gpus[1].state, reply.gpus[1].message, reply.gpus[1].holders = "failed", LONG, []
    reply.gpus[0].message = "MIG on, 5 GPU instances"
    r = run(daemon, "status", env={"COLUMNS": "120"})
    assert r.returncode == 0, r.stderr
    row0 = next(line for line in r.stdout.splitlines() if line.startswith("0 "))
    assert row0.endswith("1x3g.71gb  converged")  # the INSTANCES column already says what; no stutter
    assert all(len(line) <= 120 for line in r.stdout.splitlines()), r.stdout
    row1 = next(line for line in r.stdout.splitlines() if line.startswith("1 "))
    assert row1.endswith("\u2026") and "failed: 1 x 4g.40gb" in row1
    for selector in ("1", "0000:5c:00.0", "GPU-11111111-2222-3333-4444-555555555555"):
        detail = run(daemon, "status", selector)
        assert detail.returncode == 0, detail.stderr
        assert detail.stdout.splitlines()[0] == "GPU 1  0000:5c:00.0  NVIDIA H200"
        assert f"  message:     {LONG}" in detail.stdout.splitlines()
    assert json.loads(run(daemon, "status", "--json").stdout)["gpus"][1]["message"] == LONG
    assert json.loads(run(daemon, "status", "1", "--json").stdout)["message"] == LONG
    missing = run(daemon, "status", "9")
    assert missing.returncode == 1 and "no GPU '9'" in missing.stderr


def test_plan_of_an_invalid_file_prints_only_its_errors(daemon, tmp_path):
    f = tmp_path / "l.yaml"
    f.write_text("x: 1\n")
    daemon.handler.replies["plan"] = wire_replies.PlanReply(errors=["l.yaml:1 x: unknown key"])
    r = run(daemon, "plan", str(f))
    assert r.returncode == 4
    assert r.stdout == "error: l.yaml:1 x: unknown key\n"


def test_check_without_a_file_checks_the_daemons_file(daemon, tmp_path):
    own = tmp_path / "their-layout.yaml"
    own.write_text("version: v1\n")
    daemon.handler.replies["version"] = wire_replies.VersionReply(version="0.1.0", config=str(own))
    r = run(daemon, "check")
    assert r.returncode == 0, r.stderr
    assert calls(daemon, "check")[-1] == {"text": "version: v1\n", "path": str(own), "all_layouts": False}
    gone = run(str(tmp_path / "no.sock"), "check")  # unreachable: the default, and it says so
    assert gone.returncode != 0
    assert "cannot reach gpud" in gone.stderr and "checking /etc/gpud/layout.yaml" in gone.stderr


def test_mig_profiles_not_read_from_nvml_are_marked(daemon):
    reply = daemon.handler.replies["mig-profiles"]
    reply.gpus[0].source = "table"
    out = run(daemon, "mig", "profiles").stdout
    assert "GPU  0 0000:3b:00.0 NVIDIA H200: gpud's known table for this model, not read from NVML" in out


def test_apply_wait_prints_each_step_as_it_happens(daemon):
    def apply(args):
        daemon.handler.publish("applying", "2 MIG step(s)", gpu="0000:3b:00.0", steps=2)
        daemon.handler.publish("step", "set-mig-mode on done", gpu="0000:3b:00.0")
        daemon.handler.publish("step", "create-gi 7g.141gb@0:8 done", gpu="0000:3b:00.0")
        daemon.handler.publish("converged", "MIG on, 1 GPU instance", gpu="0000:3b:00.0")
        return wire_replies.ApplyReply(phase="converged", converged=True, message="converged")

    daemon.handler.history.append({"time": 0.0, "kind": "step", "gpu": None, "message": "old history",
                                   "data": {}})
    daemon.handler.replies["apply"] = apply
    r = run(daemon, "apply", "--wait")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(line.endswith("step 0000:3b:00.0: create-gi 7g.141gb@0:8 done") for line in lines), lines
    assert "old history" not in r.stdout  # only this apply's events
    assert lines[-1] == "apply: converged"  # not "apply: converged: converged"


def test_check_refuses_a_layout_over_gpuds_limit_before_sending(daemon, tmp_path):
    from gpud.host.files.layout_source import MAX_LAYOUT_BYTES

    assert wire.MAX_LAYOUT_TEXT == MAX_LAYOUT_BYTES  # the client's bound is the daemon's
    big = tmp_path / "big.yaml"
    big.write_text("#" * (MAX_LAYOUT_BYTES + 1))
    r = run(daemon, "check", str(big))
    assert r.returncode == 1
    assert r.stderr.strip() == (f"gpudctl: cannot check {big}: the layout is over {MAX_LAYOUT_BYTES} bytes; "
                                f"a layout may be at most {MAX_LAYOUT_BYTES} bytes (512 KiB)")
    assert calls(daemon, "check") == []


def test_a_subdivided_ci_step_and_instance_show_their_compute_slot():
    from gpud.cli.render import _describe_step, render_gpu
    from gpud.wire import replies as wr

    step = wr.StepInfo(action="create-ci", profile="1c.3g.71gb", placement=wr.Placement(start=4, size=4),
                      ci_placement=wr.Placement(start=2, size=1))
    assert _describe_step(step) == "create-ci 1c.3g.71gb@4:4 at compute 2:1"
    whole = wr.StepInfo(action="create-ci", profile="3g.71gb", placement=wr.Placement(start=4, size=4),
                       ci_placement=wr.Placement(start=0, size=3))
    assert _describe_step(whole) == "create-ci 3g.71gb@4:4"
    inst = wr.InstanceStatus(profile="2c.3g.71gb", placement=wr.Placement(start=4, size=4), gi=1, ci=1,
                            uuid="MIG-x", ci_placement=wr.Placement(start=0, size=2))
    gpu = wr.GpuStatus(index=0, pci="0000:3b:00.0", mig=wr.MigStatus(capable=True, mode="enabled", instances=[inst]))
    assert "2c.3g.71gb   {4}:4  gi 1 ci 1 at compute 0:2  MIG-x" in render_gpu(gpu)


def test_a_plan_step_reads_as_the_daemon_names_it_in_events():
    """`gpudctl plan` prints each MIG step with the words the daemon's events use for it (str of the
    planner's Step), after the trip through the wire's StepInfo."""
    from gpud.api.plan_replies import mig_step
    from gpud.cli.render import _describe_step
    from gpud.model import Placement
    from gpud.plan.mig import Step

    pci = "0000:3b:00.0"
    steps = [Step("set-mig-mode", pci, enabled=True), Step("set-mig-mode", pci, enabled=False),
             Step("destroy-ci", pci, "1g.18gb", 19, Placement(6, 1), 13, 0, uuid=MIG_UUIDS[6]),
             Step("destroy-gi", pci, "1g.18gb", 19, Placement(6, 1), 13),
             Step("create-gi", pci, "3g.71gb", 9, Placement(4, 4)),
             Step("create-ci", pci, "1c.3g.71gb", 9, Placement(4, 4), None, None, 0, ci_placement=Placement(2, 1)),
             Step("create-ci", pci, "3g.71gb", 9, Placement(4, 4), None, None, 2, ci_placement=Placement(0, 3))]
    lines = [_describe_step(mig_step(s)) for s in steps]
    assert lines == [str(s) for s in steps]
    assert lines[0] == "set-mig-mode on" and lines[5] == "create-ci 1c.3g.71gb@4:4 at compute 2:1"
    assert all(pci not in line for line in lines)  # the plan's header names the GPU


EVIL = "py\nthon\x1b[2J\x1b]0;pwned\x07\u202eexe"  # a comm set with prctl: a forged line, a screen clear, a title, bidi
EVIL_SHOWN = "py\\nthon\\x1b[2J\\x1b]0;pwned\\x07\\u202eexe"


def _unsafe(text: str) -> list[str]:
    return [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7f <= ord(c) <= 0x9f or c in "\u2028\u2029\u202e"]


def test_outside_strings_are_escaped_for_the_terminal_and_exact_in_json(daemon):
    """Issue 33 item 3: a holder's process name, an event's message and an error's text reached
    root's terminal raw; each is shown escaped, one line each, and `--json` keeps it exact."""
    reply = daemon.handler.replies["status"]
    reply.gpus[1].holders = [wire_replies.HolderInfo(pid=4121, name=EVIL, device="/dev/nvidia1")]
    reply.gpus[1].message = f"waiting for holders of /dev/nvidia1: pid 4121 {EVIL}"
    r = run(daemon, "status")
    assert r.returncode == 0, r.stderr
    assert not _unsafe(r.stdout) and EVIL_SHOWN in r.stdout
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("1 ")]
    assert len(rows) == 1 and "thon" in rows[0]  # no forged line: the name stays on its GPU's row
    doc = json.loads(run(daemon, "status", "--json").stdout)
    assert doc["gpus"][1]["holders"][0]["name"] == EVIL
    daemon.call(daemon.handler.publish, "waiting", f"pid 4121 {EVIL} holds /dev/nvidia1", "0000:5c:00.0")
    r = run(daemon, "events")
    assert not _unsafe(r.stdout) and r.stdout.rstrip().endswith(f"pid 4121 {EVIL_SHOWN} holds /dev/nvidia1")
    assert json.loads(run(daemon, "events", "--json").stdout.splitlines()[-1])["message"].endswith(
        f"{EVIL} holds /dev/nvidia1")
    daemon.handler.errors["apply"] = ApiError("failed", f"busy: {EVIL}")
    r = run(daemon, "apply")
    assert not _unsafe(r.stderr) and EVIL_SHOWN in r.stderr
