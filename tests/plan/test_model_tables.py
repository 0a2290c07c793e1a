"""The model table's lookups that every host read asks for each GPU: kept results must be the
ones a fresh computation gives, and the first model listed for a device id wins, as it did when
the table was searched in order."""

from __future__ import annotations

import msgspec

from gpud import profiles
from gpud.profiles import MODELS, by_device, with_model_ci_profiles


def test_by_device_is_the_first_model_listed_with_that_id():
    for device in {m.device for m in MODELS.values()} | {0x0, 0xFFFF}:
        assert by_device(device) is next((m for m in MODELS.values() if m.device == device), None)


def test_a_kept_table_is_the_one_computed_afresh_and_follows_its_input():
    h100 = MODELS["h100-80gb"]
    bare = tuple(msgspec.structs.replace(p, ci_profiles=()) for p in h100.profiles)  # as NVML answers without GIs
    first = with_model_ci_profiles(bare, h100.device)
    assert first == h100.profiles and with_model_ci_profiles(bare, h100.device) is first  # kept
    profiles._WITH_CI.clear()
    assert with_model_ci_profiles(bare, h100.device) == first  # computed afresh: the same
    other = bare[:2]  # another table (another object): its own answer, never the kept one
    assert with_model_ci_profiles(other, h100.device) == h100.profiles[:2]
    assert with_model_ci_profiles(bare, 0xFFFF) is bare  # an unknown model: as observed
