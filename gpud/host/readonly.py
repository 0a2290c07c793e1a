"""The guard of `--read-only`: every mutating adapter call passes through `refuse_if`.

Read-only mode exists so gpud can be pointed at a production host (or a lent GPU) and prove what
it would see without any chance of changing it.
"""


class ReadOnlyError(PermissionError):
    pass


def refuse_if(read_only: bool, call: str, target: str) -> None:
    if read_only:
        raise ReadOnlyError(f"read-only mode: refusing {call} on {target}")
