"""MIG on demand: leases on the GPUs the layout marks `mig-devices: dynamic`.

records (the durable book in STATE_DIR/leases.json), executor (a lease's NVML calls in a worker
thread, the record written around each), startup (records against NVML at start), engine
(LeaseEngine: lease, release, list; the socket and the DRA driver call it). The placement rule is
pure and lives in gpud/plan/lease_placement.py.
"""
