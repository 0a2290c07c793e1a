"""The reliability suite's round-3 trials: files gpud writes or reads as root where a user can aim
them, fair service to root, and a killed daemon's writer helpers. Each runs a real gpud process on
its own small simulated host (tests/support/daemon.Daemon); outcomes are read from the files
themselves, /proc and the simulator's state file, not from gpud's word.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

from gpud.cli.transport import Client
from gpud.sim import kernel as simkernel
from tests.reliability.trials import TrialResult, _big_layout, hardware_mismatches, layout_text, serving, status
from tests.support.daemon import Daemon, wait_until

SECRET = b"root:$6$secret-hash:19000:0:99999:7:::\n"


def _answered(path: str, op: str, args: dict | None = None, timeout: float = 30.0):
    c = Client(path, timeout=timeout)
    try:
        return c.request(op, args or {}, timeout=timeout)
    finally:
        c.close()


def trial_root_files(tmp: Path, rng: random.Random, rounds: int) -> TrialResult:
    """Links, FIFOs, directories and garbage planted where gpud writes or reads as root."""
    r = TrialResult("root's files", "a planted link never aims root's write nor leaks a root-only file; a FIFO or "
                    "directory never blocks the daemon; a bad state file is set aside, never acted on")
    secret = tmp / "shadow"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    textfiles = tmp / "textfiles"
    features = tmp / "features.d"
    textfiles.mkdir()
    features.mkdir()
    prom, nfd = textfiles / "gpud.prom", features / "gpud"
    d = Daemon(tmp / "files", ["h100-80gb:2"], layout_text([None, None]),
               extra_args=["--metrics-textfile", str(prom), "--nfd-features", str(nfd)])
    path = str(d.socket)
    try:
        for n in range(rounds):
            what = rng.choice(["link-temp", "link-target", "fifo-nfd", "link-nfd", "marker", "state-restart"])
            r.tries += 1
            if what == "link-temp":  # prometheus_client's old temp name, and random guesses
                for name in [f"gpud.prom.{d.proc.pid}.{t}" for t in range(3)] + [f".gpud.prom.gpud-{n:032x}"]:
                    p = textfiles / name
                    if not os.path.lexists(p):
                        p.symlink_to(secret)
                _answered(path, "reload")
                _answered(path, "apply", {"wait": True, "timeout": 60}, timeout=90)
            elif what == "link-target":
                if os.path.lexists(prom):
                    prom.unlink()
                prom.symlink_to(secret)
                d.config.write_text(layout_text([None, None]) + f"# round {n}\n")  # a change: metrics rewritten
                _answered(path, "reload")
                _answered(path, "apply", {"wait": True, "timeout": 60}, timeout=90)
            elif what in ("fifo-nfd", "link-nfd"):
                if os.path.lexists(nfd):
                    nfd.unlink()
                os.mkfifo(nfd) if what == "fifo-nfd" else nfd.symlink_to(secret)
                reply = _answered(path, "labels")
                if b"secret-hash" in repr(reply).encode():
                    r.fail(f"round {n}: `labels` showed the linked root-only file")
            elif what == "marker":
                marker = d.state_dir / "reboot-request.json"
                kind = rng.choice(["fifo", "dir", "garbage"])
                if os.path.lexists(marker):
                    os.remove(marker) if not marker.is_dir() or marker.is_symlink() else os.rmdir(marker)
                {"fifo": lambda: os.mkfifo(marker), "dir": lambda: marker.mkdir(),
                 "garbage": lambda: marker.write_text('{"reason": 1}')}[kind]()
                _answered(path, "apply", {"wait": True, "timeout": 60}, timeout=90)
                events = _answered(path, "events").events
                if any("settled it" in e.message for e in events):
                    r.fail(f"round {n}: a {kind} at the reboot marker was read as a reboot")
            else:  # a restart over FIFOs at the state files read at start
                d.proc.send_signal(signal.SIGKILL)
                d.proc.wait()
                for name in ("gpu-index.json", "boot.json", "vgpu-record.json"):
                    p = d.state_dir / name
                    if os.path.lexists(p):
                        os.rename(p, d.state_dir / f"{name}.moved-{n}")
                    os.mkfifo(p)
                d.start()  # Daemon.start waits for gpud to answer (bounded): a hang fails the trial
            if secret.read_bytes() != SECRET:
                r.fail(f"round {n} ({what}): the root-only file was overwritten")
                secret.write_bytes(SECRET)
            if not serving(d):
                r.fail(f"round {n} ({what}): root's status not answered")
                continue
            r.outcomes[f"{what}: refused or replaced, daemon serving"] += 1
    finally:
        d.stop()
    return r


def trial_fair_service(tmp: Path, rounds: int, checkers: int, applies: int) -> TrialResult:
    """Heavy checks flood the socket while root reloads; many applies arrive together."""
    r = TrialResult("fair service", "root's reload is answered while `check --all-layouts` floods; applies sent "
                    "together are all answered, none closed")
    layouts = "\n".join(f"  l{i}:\n    - {{devices: all, mig-enabled: false}}" for i in range(8))
    heavy = _big_layout(240 * 1024).replace("layouts:\n", f"layouts:\n{layouts}\n", 1)
    d = Daemon(tmp / "fair", ["h100-80gb:2"], layout_text([None, None]))
    path = str(d.socket)
    try:
        for n in range(rounds):
            stop = threading.Event()
            done: list[str] = []

            def flood() -> None:
                while not stop.is_set():
                    try:
                        _answered(path, "check", {"text": heavy, "path": "big.yaml", "all_layouts": True}, 300)
                        done.append("ok")
                    except Exception as e:  # noqa: BLE001 - counted
                        done.append(type(e).__name__)
            threads = [threading.Thread(target=flood, daemon=True) for _ in range(checkers)]
            for t in threads:
                t.start()
            wait_until(lambda: len(done) >= 1, timeout=300, what="the flood under way")
            r.tries += 1
            try:
                reply = _answered(path, "reload", timeout=30)
                r.outcomes["reload answered during the flood" if reply.valid else "reload answered: invalid"] += 1
            except Exception as e:  # noqa: BLE001 - the promise
                r.fail(f"round {n}: root's reload not answered during {checkers} flooding checks: {e}")
            stop.set()
            for t in threads:
                t.join(600)
        # applies arriving together
        per_gpu = [{"7g.80gb": 1}, None]
        d.config.write_text(layout_text(per_gpu))
        answers: list[str] = []

        def apply_once() -> None:
            try:
                answers.append("converged" if _answered(path, "apply", {"wait": True, "timeout": 120}, 150).converged
                               else "not converged")
            except Exception as e:  # noqa: BLE001 - counted
                answers.append(type(e).__name__)
        threads = [threading.Thread(target=apply_once, daemon=True) for _ in range(applies)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        r.tries += len(threads)
        for a in answers:
            r.outcomes[f"apply: {a}"] += 1
        if answers.count("converged") != applies:
            r.fail(f"{applies} applies at once: {sorted(set(answers))}")
        pcis = [g["pci"] for g in status(d)["gpus"]]
        wrong = hardware_mismatches(d, per_gpu, pcis)
        if wrong:
            r.fail(f"after {applies} applies: {wrong}")
    finally:
        d.stop()
    return r


def trial_writer_helpers(tmp: Path, kills: int) -> TrialResult:
    """kill -9 while an unbind's helper is blocked: no helper outlives its daemon."""
    r = TrialResult("kill -9 with a blocked writer", "a writer helper never outlives a killed gpud; the restart "
                    "serves")
    d = Daemon(tmp / "writers", ["h100-80gb:1"], layout_text([None]), extra_args=["--unbind-timeout", "600"])
    path = str(d.socket)
    try:
        pci = status(d)["gpus"][0]["pci"]
        for n in range(kills):
            r.tries += 1
            d.sim("hang", pci)  # the unbind will block in the (simulated) kernel
            d.config.write_text("version: v1\nlayouts:\n  t:\n    - {devices: all, workload: vm-passthrough}\n")
            _answered(path, "reload")
            root = str(d.host / "sys")
            from gpud.host.kernel.writer_leftovers import _helpers

            wait_until(lambda: bool(_helpers(root, "/proc")), timeout=120, what="the unbind's helper")
            pids = [p for p, _, _ in _helpers(root, "/proc")]
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait()
            deadline = time.monotonic() + 30
            while any(os.path.exists(f"/proc/{p}") and _alive(p) for p in pids) and time.monotonic() < deadline:
                time.sleep(0.05)
            left = [p for p in pids if _alive(p)]
            if left:
                r.fail(f"kill {n}: writer helper(s) {left} outlived the killed daemon")
                for p in left:
                    os.kill(p, signal.SIGKILL)
            simkernel.unhang(d.host, pci)
            d.config.write_text(layout_text([None]))
            d.start()
            r.outcomes["helpers gone with the daemon, restart serving" if not left else "helpers left"] += 1
    finally:
        d.stop()
    return r


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False
