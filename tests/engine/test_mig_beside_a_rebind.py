"""One pass that moves a GPU from nvidia to vfio-pci and creates MIG instances on two others.

The rebind closes NVML (an unbind waits for every open handle), so reads meanwhile show the last
good NVML view. MIG work planned from that view planned steps already done again: a compute instance
created before the read was created a second time and failed INSUFFICIENT_RESOURCES. The
reconciler now re-reads before it runs MIG steps planned from such a view. Checked against the
simulator's own state file: every GPU instance holds exactly one compute instance."""

from __future__ import annotations

from gpud.sim import state as simstate
from tests.scenarios.definitions import layout, mig
from tests.support.simrig import SimRig


async def test_mig_on_two_gpus_while_a_third_leaves_nvidia(tmp_path):
    rig = SimRig(tmp_path, ("a100-40gb:1", "h100-80gb:2"))
    try:
        assert await rig.apply(layout(mig([0], {"3g.20gb": 2}), mig([1], {"1g.10gb": 4, "3g.40gb": 1}),
                                      {"devices": [2], "workload": "vm-passthrough"}))
        assert rig.rec.phase == "converged", [s.message for s in rig.rec.gpu_states.values()]
        st = simstate.load(rig.dir)
        a100, h100, passthrough = sorted(st.gpus)
        assert [len(st.gpus[a].gis) for a in (a100, h100)] == [2, 5]
        assert all(len(gi.cis) == 1 for a in (a100, h100) for gi in st.gpus[a].gis)
        assert st.functions[passthrough].driver == "vfio-pci"
    finally:
        rig.close()
