"""The installed gpudctl launcher (packaging/gpudctl.in, filled in by packaging/build-deb.sh):
python started with -I -S and only gpudctl's own paths, so nothing from the environment or from
`site` (which runs every .pth file of site-packages) is paid for or can change what it imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgpack

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "packaging" / "gpudctl.in"


def _launcher(tmp: Path) -> Path:
    """The template filled in as build-deb.sh does, for this checkout and this interpreter."""
    site = str(Path(msgpack.__file__).parents[1])
    text = TEMPLATE.read_text().replace("@PYTHON@", os.path.realpath(sys.executable)).replace(
        "@PATHS@", repr([str(REPO), site]))
    path = tmp / "gpudctl"
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_template_starts_python_isolated_without_site():
    first = TEMPLATE.read_text().splitlines()[0]
    assert first == "#!@PYTHON@ -IS"
    build = (REPO / "packaging" / "build-deb.sh").read_text()
    assert "packaging/gpudctl.in" in build and '>"$STAGE$PREFIX/bin/gpudctl"' in build


def test_launcher_answers_and_ignores_the_environment(daemon, tmp_path):
    launcher = _launcher(tmp_path)
    # A PYTHONPATH that would break gpudctl if it were honoured: -I ignores it.
    poison = tmp_path / "poison"
    (poison / "gpud").mkdir(parents=True)
    (poison / "gpud" / "__init__.py").write_text("raise ImportError('PYTHONPATH was used')\n")
    (poison / "msgspec.py").write_text("raise ImportError('PYTHONPATH was used')\n")
    env = {**os.environ, "PYTHONPATH": str(poison), "PYTHONSTARTUP": str(poison / "msgspec.py")}
    r = subprocess.run([str(launcher), "--socket", daemon.path, "status", "--json"], capture_output=True,
                       text=True, timeout=60, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["gpus"][0]["pci"]
    r = subprocess.run([str(launcher), "--socket", str(tmp_path / "none.sock"), "status"], capture_output=True,
                       text=True, timeout=60, env=env, cwd=tmp_path)
    assert r.returncode == 3 and "cannot reach gpud" in r.stderr


# Modules a `gpudctl status` has no use for, each costing a measurable share of its start-up on the
# lent H200 host (bench/results/h200-status-timing.md): socket's enum wrappers, shutil (and its
# archive modules, which argparse's help formatter imports for the terminal size), threading (only
# `apply --wait`), locale (argparse's gettext look-ups), typing_extensions and the inspect it pulls
# in, msgspec (and typing, which came with it: the client reads replies with msgpack, gpud.cli.view),
# what only other commands use (the MIG words, the nvidia-smi tables, the VM views, select for
# `apply --wait`, json for --json), the daemon's side of gpud.
NOT_IMPORTED = ("socket", "shutil", "threading", "locale", "bz2", "lzma", "typing_extensions", "inspect",
                "msgspec", "typing", "gpud.wire.protocol", "gpud.wire.replies", "gpud.mig_text", "gpud.cli.render_smi",
                "gpud.cli.render_vm", "select", "json",
                "gpud.engine", "gpud.host", "gpud.sim", "gpud.plan", "gpud.layout", "yaml", "pynvml", "asyncio")


def test_status_imports_only_what_it_uses(daemon, tmp_path):
    """The launcher's run of `status`, printing the modules it loaded as the process ends (gpudctl
    ends it with os._exit), and whether the garbage collector was on again by then."""
    launcher = _launcher(tmp_path)
    text = launcher.read_text().replace(
        "\nrun()", "\nimport os\nend = os._exit\n"
        "def _exit(code):\n    import gc\n    print('GC', gc.isenabled(), file=sys.stderr)\n"
        "    print('MODULES', ' '.join(sorted(k for k, v in sys.modules.items() if v is not None)), file=sys.stderr)\n    sys.stderr.flush()\n"
        "    end(code)\nos._exit = _exit\nrun()")
    assert text != launcher.read_text()
    launcher.write_text(text)
    r = subprocess.run([str(launcher), "--socket", daemon.path, "status"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    loaded = set(r.stderr.split("MODULES ", 1)[1].split())
    unwanted = sorted(m for m in loaded if m in NOT_IMPORTED or m.startswith(tuple(n + "." for n in NOT_IMPORTED)))
    assert not unwanted, unwanted
    assert "gpud.cli.render" in loaded and "msgpack" in loaded  # the check saw a real run
    assert "GC True" in r.stderr  # off only while the client was imported (gpud/cli/program.py)
