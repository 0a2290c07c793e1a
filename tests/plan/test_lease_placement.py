"""Lease placement (gpud.plan.lease_placement) against the simulator's own MIG rules.

Every placement chosen is handed to gpud.sim.gpu_rules.create_gi, the rule the simulated driver
applies (it refuses a start the profile does not offer, a taken slice and a full profile), and a
refusal is checked against the same rules: no GPU had a free placement of that profile."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpud.model import Placement
from gpud.plan.lease_placement import Choice, NoRoom, Room, UnknownProfile, choose, exact
from gpud.profiles import MODELS
from gpud.sim import gpu_rules
from gpud.sim.state import SimGpu
from tests.support.present import present

SETTINGS = settings(derandomize=True, max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
H100 = MODELS["h100-80gb"]
MIG_MODELS = [k for k, m in MODELS.items() if m.mig_capable and not m.unknown]


def sim_gpu(model: str, n: int) -> SimGpu:
    return SimGpu(address=f"0000:{n:02x}:00.0", model=model, uuid=f"GPU-{n}", minor=n, mig_mode=1, mig_pending=1)


def room(g: SimGpu, index: int) -> Room:
    """The GPU as a lease sees it, read from the simulator's state (every GI, whoever made it)."""
    used = tuple((gi.profile_id, Placement(gi.start, gi.size)) for gi in g.gis)
    return Room(g.address, index, MODELS[g.model].profiles, used)


def lease(gpus: list[SimGpu], name: str, spread: bool = False):
    """choose() over the GPUs, then the simulator creates it (raising if the rules refuse)."""
    got = choose(name, [room(g, i) for i, g in enumerate(gpus)], spread=spread)
    if isinstance(got, Choice):
        g = next(g for g in gpus if g.address == got.pci)
        model = MODELS[g.model]
        gpu_rules.create_gi(g, model, present(gpu_rules.profile_of(model, got.profile.id)), got.placement.start,
                            got.placement.size)
    return got


def test_seed_partial_layout_lease_by_lease_on_an_empty_h100():
    g = sim_gpu("h100-80gb", 1)
    for name in ("1g.10gb", "1g.10gb", "1g.10gb", "3g.40gb", "1g.10gb"):
        assert isinstance(lease([g], name), Choice), name
    layout = sorted((present(gpu_rules.profile_of(H100, gi.profile_id)).name, gi.start) for gi in g.gis)
    assert layout == [("1g.10gb", 0), ("1g.10gb", 1), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4)]


def test_nvml_default_order_loses_the_seed_layout():
    """The same five leases through the simulated driver's own choice (no placement given) fail:
    the reason placement is gpud's business."""
    g = sim_gpu("h100-80gb", 1)
    prof = {p.name: p for p in H100.profiles}
    with pytest.raises(gpu_rules.Refused):
        for name in ("1g.10gb", "1g.10gb", "1g.10gb", "3g.40gb", "1g.10gb"):
            gpu_rules.create_gi(g, H100, prof[name], None, None)


def test_foreign_instances_are_avoided():
    g = sim_gpu("h100-80gb", 1)
    prof = {p.name: p for p in H100.profiles}
    gpu_rules.create_gi(g, H100, prof["3g.40gb"], 0, 4)  # `nvidia-smi mig -cgi` by someone else
    got = lease([g], "3g.40gb")
    assert isinstance(got, Choice) and got.placement == Placement(4, 4)
    refused = lease([g], "1g.10gb")
    assert isinstance(refused, NoRoom)
    assert "free memory slices none (0 of 8)" in refused.message


def test_pack_fills_a_used_gpu_spread_the_emptiest():
    a, b = sim_gpu("h100-80gb", 1), sim_gpu("h100-80gb", 2)
    assert lease([a, b], "1g.10gb").pci == a.address
    assert lease([a, b], "1g.10gb").pci == a.address  # pack (the default): the used GPU again
    assert lease([a, b], "1g.10gb", spread=True).pci == b.address


def test_shortfall_names_what_is_free_and_what_fits():
    g = sim_gpu("h100-80gb", 1)
    for _ in range(2):
        assert isinstance(lease([g], "3g.40gb"), Choice)
    got = lease([g], "1g.10gb")
    assert isinstance(got, NoRoom) and got.message.startswith("no dynamic GPU has room for 1g.10gb: ")


def test_unknown_profile_and_exact_placement():
    g = sim_gpu("h100-80gb", 1)
    assert isinstance(choose("5g.50gb", [room(g, 0)]), UnknownProfile)
    assert isinstance(exact("3g.40gb", room(g, 0), 2), NoRoom)  # 3g starts at 0 or 4 only
    got = exact("3g.40gb", room(g, 0), 4)
    assert isinstance(got, Choice) and got.placement == Placement(4, 4)
    gpu_rules.create_gi(g, H100, got.profile, 4, 4)
    assert isinstance(exact("1g.10gb", room(g, 0), 5), NoRoom)


def test_ci_variants_name_a_gi_and_its_ci():
    got = choose("1c.3g.40gb", [room(sim_gpu("h100-80gb", 1), 0)])
    assert isinstance(got, Choice) and got.profile.name == "3g.40gb" and got.ci.slices == 1


@given(model=st.sampled_from(MIG_MODELS), seed=st.integers(0, 2**32 - 1), spread=st.booleans())
@SETTINGS
def test_random_churn_is_valid_by_the_simulators_rules(model: str, seed: int, spread: bool):
    rnd = random.Random(seed)
    gpus = [sim_gpu(model, n) for n in range(1, 4)]
    names = [p.name for p in MODELS[model].profiles]
    # someone else's instance on the first GPU, where the driver puts it
    foreign = gpu_rules.create_gi(gpus[0], MODELS[model], MODELS[model].profiles[-1], None, None)
    for _ in range(40):
        if rnd.random() < 0.35:
            mine = [(g, gi) for g in gpus for gi in g.gis if gi is not foreign]
            if mine:
                g, gi = rnd.choice(mine)
                g.gis.remove(gi)
            continue
        name = rnd.choice(names)
        got = lease(gpus, name, spread)  # create_gi raises on any placement the rules refuse
        if isinstance(got, NoRoom):
            prof = next(p for p in MODELS[model].profiles if p.name == name)
            assert all(gpu_rules.gi_capacity(g, prof) == 0 for g in gpus), name
        else:
            assert isinstance(got, Choice)
    assert foreign in gpus[0].gis
