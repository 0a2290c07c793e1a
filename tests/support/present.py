"""`present(x)`: a value a test expects to be there, or a failure saying it is missing. The product
returns Optional where absence is a real case; a test that expects presence says so with this."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def present(value: T | None, what: str = "a value") -> T:
    assert value is not None, f"expected {what}, got None"
    return value
