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
