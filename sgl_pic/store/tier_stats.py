"""The stats of the tiered store: its tiers' ``StoreStats`` summed into one, as a single
store would count them. Pure; changes nothing."""

from __future__ import annotations

from types import MappingProxyType

from sgl_pic.store.base import StoreStats


def sum_tier_stats(h: StoreStats, d: StoreStats, s: StoreStats | None) -> StoreStats:
    """Host ``h``, disk ``d`` and shared ``s`` (None without one) summed. Errors of the
    shared tier are reported as ``shared_<kind>`` (e.g. ``shared_corrupt``), apart from
    the local tiers'. A lookup missing in one tier and hitting in the next is one hit,
    and a miss only where the last tier missed."""
    errors = dict(d.errors)
    for kind, n in h.errors.items():
        errors[kind] = errors.get(kind, 0) + n
    if s is not None:
        for kind, n in s.errors.items():
            errors[f"shared_{kind}"] = n
    return StoreStats(
        entries=h.entries + d.entries,
        bytes_used=h.bytes_used + d.bytes_used,
        capacity_bytes=h.capacity_bytes + d.capacity_bytes,
        # A host miss that hits on disk is one hit, not a miss and a hit.
        hits=h.hits + d.hits + (s.hits if s else 0),
        misses=s.misses if s else d.misses,
        puts=h.puts + d.puts,
        rejected_puts=h.rejected_puts + d.rejected_puts,
        evictions=h.evictions + d.evictions,
        evicted_bytes=h.evicted_bytes + d.evicted_bytes,
        bytes_read=h.bytes_read + d.bytes_read + (s.bytes_read if s else 0),
        errors=MappingProxyType(errors),
    )
