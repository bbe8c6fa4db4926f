"""The server launcher's failure path: a server that exits is reported with its log."""

from __future__ import annotations

import pytest

from sgl_pic.cli.server_process import server_process


def test_a_server_that_exits_raises_with_its_log() -> None:
    with (
        pytest.raises(RuntimeError) as err,
        server_process(["--pic-policy", "nope"], startup_timeout_s=120),
    ):
        pytest.fail("an invalid flag must not give a healthy server")
    assert "server exited with 2" in str(err.value)
    assert "invalid choice: 'nope'" in str(err.value)


def test_a_port_taken_before_the_server_binds_it_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first port chosen is taken by the time the server binds it: the server logs the
    bind error and stays up; the launcher starts it again on another port instead of
    waiting for the timeout."""
    import socket
    from pathlib import Path

    import requests

    from sgl_pic.cli import server_process as launcher

    root = Path(__file__).resolve().parents[2]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        ports = iter([taken])
        real = launcher.free_port
        monkeypatch.setattr(launcher, "free_port", lambda: next(ports, None) or real())
        with server_process(
            [], startup_timeout_s=60, cwd=str(root), module="tests.cli.fake_launcher"
        ) as proc:
            assert not proc.url.endswith(f":{taken}")
            assert requests.get(proc.url + "/health", timeout=5).status_code == 200
