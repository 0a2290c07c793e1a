"""The one build step pyproject.toml cannot declare: gpudctl's script.

pip writes a console script that runs `site` before gpudctl's first line (every .pth file of
site-packages, an editable install's finder), and a wheel cannot ask for interpreter flags: an
installer rewrites `#!python` and drops what follows it. So gpudctl is not a console-script entry
point but this script, from packaging/gpudctl-pip.in: it starts the environment's interpreter with
-I -S, as the package's launcher does. For an editable build (setuptools' editable_wheel marks
build_scripts with editable_mode) the project directory is written into it, where gpud is found
without the finder; the project directory is what an editable install points at anyway.
"""

from __future__ import annotations

import os

from setuptools import Command, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
TEMPLATE = os.path.join("packaging", "gpudctl-pip.in")


class BuildGpudctl(Command):
    """`build_scripts`: writes the one script into the directory `install_scripts` copies from."""

    description = "write the gpudctl script"
    user_options: list[tuple[str, str | None, str]] = []
    editable_mode = False  # set by setuptools' editable_wheel on each build sub-command that has it

    def initialize_options(self) -> None:
        self.build_dir: str | None = None
        self.force = None
        self.executable = None  # what setuptools sets on build_scripts; the script names none

    def finalize_options(self) -> None:
        self.set_undefined_options("build", ("build_scripts", "build_dir"), ("force", "force"))

    def get_source_files(self) -> list[str]:
        return [TEMPLATE]

    def run(self) -> None:
        with open(os.path.join(ROOT, TEMPLATE), encoding="utf-8") as f:
            text = f.read().replace("@SOURCE@", repr(ROOT) if self.editable_mode else "None")
        assert self.build_dir is not None  # finalize_options took it from `build`
        self.mkpath(self.build_dir)
        out = os.path.join(self.build_dir, "gpudctl")
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(out, 0o755)


setup(scripts=[TEMPLATE], cmdclass={"build_scripts": BuildGpudctl})
