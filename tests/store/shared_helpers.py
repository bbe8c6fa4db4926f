"""Helpers for tests that need a real shared store (Mooncake master + holder) running."""

from __future__ import annotations

import random
import socket
import tempfile

import pytest

from sgl_pic.store.shared.service import ServiceConfig, ServiceError, SharedStoreService


def free_port_block(n: int = 4) -> int:
    """A base port whose ``n`` consecutive ports are free now."""
    for _ in range(200):
        base = random.randrange(20000, 60000 - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free block of ports")


def start_service(memory_mb: int = 64) -> SharedStoreService:
    """A started store on free ports. A store that cannot start fails the test with the
    reason (the shared tier is part of what is tested: never skipped)."""
    config = ServiceConfig(
        port=free_port_block(),
        memory_mb=memory_mb,
        log_dir=tempfile.mkdtemp(prefix="sgl_pic_store_"),
    )
    service = SharedStoreService(config)
    try:
        service.start()
    except ServiceError as exc:
        pytest.fail(f"the shared store could not start (bash scripts/install.sh): {exc}")
    return service
