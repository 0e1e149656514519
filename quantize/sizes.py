"""Byte counts as people read them."""

from __future__ import annotations

__all__ = ["GB", "GiB", "fmt_bytes"]

GiB, GB = 2**30, 10**9


def fmt_bytes(n: int) -> str:
    if n >= GiB / 10:
        return f"{n / GiB:,.1f} GiB ({n / GB:,.1f} GB)"
    return f"{n / 2**20:,.2f} MiB"
