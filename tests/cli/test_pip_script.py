"""The gpudctl that `pip install .` and `pip install -e .` put in a venv (packaging/gpudctl-pip.in,
written by setup.py): the wheels built by setuptools' own hooks, installed by pip into fresh venvs
(bench/venvs.py), run against a real socket server.

What is checked is what the script promises: it runs with -I -S semantics (PYTHONPATH ignored, no
`site`: a .pth file of the venv that would leave a mark never runs; typing_extensions, present in
the venv, is never imported), an editable install runs the project's files as they are now, and a
copy of the script outside its venv still works, through `site`, as pip's console script would.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from bench import venvs

# Each leaves a line in the file $GPUD_TEST_MARK names, when it runs.
MARK_PTH = 'import os; p = os.environ.get("GPUD_TEST_MARK"); p and open(p, "a").write("site\\n")\n'
MARK_TYPING_EXTENSIONS = ('import os\np = os.environ.get("GPUD_TEST_MARK")\n'
                          'p and open(p, "a").write("typing_extensions\\n")\nraise ImportError("a stand-in")\n')


def _site_packages(bin_dir: Path) -> Path:
    [site] = (bin_dir.parent / "lib").glob("python3.*/site-packages")
    return site


def _prepare(bin_dir: Path) -> None:
    """A .pth file that marks each run of `site`, and a typing_extensions that fails to import."""
    site = _site_packages(bin_dir)
    (site / "gpud-test-mark.pth").write_text(MARK_PTH)
    (site / "typing_extensions.py").write_text(MARK_TYPING_EXTENSIONS)


@pytest.fixture(scope="module")
def installs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pip-installs")
    source = venvs.copy_source(root / "src")
    out = {}
    for kind, editable in (("regular", False), ("editable", True)):
        wheel = venvs.build_wheel(source, root / f"wheel-{kind}", editable=editable)
        out[kind] = venvs.make_venv(root / kind, wheel)
        _prepare(out[kind])
    out["source"] = source
    return out


def _run(script: Path, *args: str, tmp: Path,
         env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], bool]:
    """Runs the script; also says whether `site` ran (the venv's .pth left its mark). Whatever the
    path, typing_extensions is never imported."""
    mark = tmp / "marks"
    mark.unlink(missing_ok=True)
    r = subprocess.run([str(script), *args], capture_output=True, text=True, timeout=60, cwd=tmp,
                       env={**venvs.env_without_python_vars(), **(env or {}), "GPUD_TEST_MARK": str(mark)})
    marks = set(mark.read_text().split()) if mark.exists() else set()
    assert "typing_extensions" not in marks
    return r, "site" in marks


def test_pip_installs_a_script_not_an_entry_point(installs):
    for kind in ("regular", "editable"):
        bin_dir = installs[kind]
        assert (bin_dir / "gpudctl").read_text().startswith("#!/bin/sh\n")
        [info] = _site_packages(bin_dir).glob("gpud-*.dist-info")
        assert "gpudctl" not in (info / "entry_points.txt").read_text()
        assert (bin_dir / "gpud").read_text().startswith(f"#!{bin_dir}/python")  # pip's, for the daemon


def test_the_regular_install_runs_isolated_and_without_site(installs, daemon, tmp_path):
    script = installs["regular"] / "gpudctl"
    # A PYTHONPATH that would break gpudctl if it were honoured: -I ignores it.
    poison = tmp_path / "poison"
    (poison / "gpud").mkdir(parents=True)
    (poison / "gpud" / "__init__.py").write_text("raise ImportError('PYTHONPATH was used')\n")
    (poison / "msgspec.py").write_text("raise ImportError('PYTHONPATH was used')\n")
    r, site_ran = _run(script, "--socket", daemon.path, "status", "--json", tmp=tmp_path,
                       env={"PYTHONPATH": str(poison)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["gpus"][0]["pci"]
    assert not site_ran
    r, site_ran = _run(script, "--socket", str(tmp_path / "none.sock"), "status", tmp=tmp_path)
    assert r.returncode == 3 and "cannot reach gpud" in r.stderr and not site_ran


def test_a_symlink_to_the_script_finds_its_venv(installs, daemon, tmp_path):
    link = tmp_path / "bin" / "gpudctl"
    link.parent.mkdir()
    link.symlink_to(installs["regular"] / "gpudctl")
    r, site_ran = _run(link, "--socket", daemon.path, "version", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not site_ran


def test_the_editable_install_runs_the_project_as_it_is_now_without_its_finder(installs, daemon, tmp_path):
    site = _site_packages(installs["editable"])
    assert list(site.glob("__editable__*gpud*.pth"))  # what `site` would have run: the finder
    init = installs["source"] / "gpud" / "__init__.py"
    before = init.read_text()
    init.write_text(before + "import sys as _sys\n_sys.stderr.write('gpud from the project directory\\n')\n")
    try:
        r, site_ran = _run(installs["editable"] / "gpudctl", "--socket", daemon.path, "status", tmp=tmp_path)
    finally:
        init.write_text(before)
    assert r.returncode == 0, r.stderr
    assert "gpud from the project directory" in r.stderr
    assert not site_ran


def test_a_copy_outside_its_venv_runs_as_a_console_script_would(installs, daemon, tmp_path):
    """Beside a copy of pip's `gpud` script (so the interpreter is found) but outside the venv: the
    paths are not known without `site`, so the script starts again with it, and still answers."""
    bin_dir = tmp_path / "elsewhere"
    bin_dir.mkdir()
    for name in ("gpudctl", "gpud"):
        (bin_dir / name).write_bytes((installs["regular"] / name).read_bytes())
        (bin_dir / name).chmod(0o755)
    r, site_ran = _run(bin_dir / "gpudctl", "--socket", daemon.path, "status", "--json", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["gpus"][0]["pci"]
    assert site_ran


def test_without_an_interpreter_beside_it_the_script_says_so(installs, tmp_path):
    lone = tmp_path / "gpudctl"
    lone.write_bytes((installs["regular"] / "gpudctl").read_bytes())
    lone.chmod(0o755)
    r = subprocess.run([str(lone), "version"], capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert r.returncode == 1
    assert r.stderr.startswith(f"gpudctl: no Python for {lone}: neither {tmp_path}/gpud names one")
