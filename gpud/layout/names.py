"""MIG device names as layout.yaml writes them (`1g.18gb`, `1g.18gb+me`, `1c.3g.71gb`).

A name is only syntax until it meets a GPU model's profile table: `1g.10gb` is an H100 profile and
means nothing on an H200 (mig-parted #157 resolved it against the wrong model). So this module
splits parsing (`parse_mig_name`, no table needed) from lookup (`find_profile`, against the table of
the one GPU being planned). Both are pure and cheap: the planner calls them in its inner loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from msgspec import Struct

from gpud.mig_text import split_name
from gpud.model import CiProfile, GpuInstance, MigProfile, NvmlGpu


class MigName(Struct, frozen=True):
    """A parsed MIG device name. `ci_slices` is None for the GI's default (whole) compute instance."""

    ci_slices: int | None
    gi_slices: int
    memory_gb: int
    media_extensions: bool
    suffix: str = ""  # "+me", "-me", "+me.all", "+gfx" or ""

    @property
    def gi_name(self) -> str:
        """The GPU-instance profile name, as NVML's profile table spells it (`3g.40gb`)."""
        return f"{self.gi_slices}g.{self.memory_gb}gb{self.suffix}"

    def __str__(self) -> str:
        ci = f"{self.ci_slices}c." if self.ci_slices is not None else ""
        return ci + self.gi_name


@lru_cache(maxsize=1024)
def parse_mig_name(name: str) -> MigName | None:
    """Split a MIG device name into its parts; None when it is not one (no table is consulted).
    The grammar is gpud.mig_text's, shared with the client."""
    parts = split_name(name)
    if parts is None:
        return None
    ci_slices, gi_slices, memory_gb, suffix = parts
    return MigName(ci_slices, gi_slices, memory_gb, suffix.startswith("+me"), suffix)


def find_profile(name: str, profiles: Sequence[MigProfile]) -> tuple[MigProfile, CiProfile | None] | None:
    """Look `name` up in one GPU model's table: (GI profile, CI profile or None for the default CI).

    None when the name is malformed, the GI profile is not in the table, or the `Nc` part is not a
    compute-instance size of that GI profile.
    """
    parsed = parse_mig_name(name)
    if parsed is None:
        return None
    gi_name = parsed.gi_name
    profile = next((p for p in profiles if p.name == gi_name), None)
    if profile is None:
        return None
    if parsed.ci_slices is None:
        return profile, None
    ci = next((c for c in profile.ci_profiles if c.slices == parsed.ci_slices), None)
    return (profile, ci) if ci is not None else None


def device_name(gi: MigProfile, ci_slices: int | None = None) -> str:
    """A MIG device's name: `3g.40gb`, or `1c.3g.40gb` for a compute instance smaller than its GPU
    instance (what nvidia-smi and the device plugin call it)."""
    if ci_slices is None or ci_slices >= gi.slices:
        return gi.name
    return f"{ci_slices}c.{gi.name}"


def sorted_names(profiles: Sequence[MigProfile]) -> list[str]:
    """GI profile names smallest first: the order people read `nvidia-smi mig -lgip` in."""
    return [p.name for p in sorted(profiles, key=lambda p: (p.slices, p.memory_mb, p.name))]


def ci_names(profile: MigProfile) -> list[str]:
    """Every `Nc.<gi>` name a GI profile can be split into, smallest first."""
    return [f"{c.slices}c.{profile.name}" for c in sorted(profile.ci_profiles, key=lambda c: c.slices)]


def mig_device_name(nvml: NvmlGpu, gi: GpuInstance, ci_slices: int | None) -> str:
    """An existing MIG device's name from its GPU's own profile table (`ci_slices` None: the GI
    without a compute instance, named as the GI)."""
    prof = nvml.profile(gi.profile_id)
    return device_name(prof, ci_slices) if prof is not None else f"profile-{gi.profile_id}"
