"""`gpud qualify`: can gpud do its job on this host, and what will stop it (docs/qualify.md).

main: the command line and wiring (gpud.hardware picks the host); checks: the read-only checks;
exercise: `--mutate`, each hardware path once on one idle GPU under the apply lock; report: the
checks' record, the verdict, text and JSON. Above the engine and the host adapters, below nothing
but gpud.main.
"""
