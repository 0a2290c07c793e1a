"""The reboot marker request_reboot writes is the one reboot_outcome reads back: the marker is
what stops a reboot that did not help from repeating, so a marker its own reader sets aside
would make every request look foreign."""

from __future__ import annotations

import json

from gpud.host.systemd import logind


def test_the_marker_written_before_the_call_reads_back_as_written(tmp_path):
    boot_id = tmp_path / "boot_id"
    boot_id.write_text("11111111-2222-3333-4444-555555555555\n")
    state = tmp_path / "state"
    state.mkdir()
    assert logind.mark_reboot(str(state), "MIG mode change needs a reboot", boot_id_path=str(boot_id))
    on_disk = json.loads((state / logind.REBOOT_MARKER).read_text())
    assert set(on_disk) == {"reason", "boot_id", "requested_at"}
    rec = logind.reboot_outcome(str(state), boot_id_path=str(boot_id))
    assert rec is not None and rec.set_aside is None
    assert (rec.reason, rec.boot_id, rec.rebooted) == ("MIG mode change needs a reboot",
                                                       "11111111-2222-3333-4444-555555555555", False)
    boot_id.write_text("66666666-2222-3333-4444-555555555555\n")  # the machine came back
    after = logind.reboot_outcome(str(state), boot_id_path=str(boot_id))
    assert after is not None and after.rebooted and after.reason == "MIG mode change needs a reboot"
    # ...and a second request after that reboot is refused, the marker kept for the operator
    assert not logind.mark_reboot(str(state), "again", boot_id_path=str(boot_id))
    assert json.loads((state / logind.REBOOT_MARKER).read_text()) == on_disk
