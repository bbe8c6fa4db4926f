"""The soak's faults (``bench/soak.py``), each injected in its own ``Window``: kill -9 of
server a and its restart on the same disk tier; its disk tier's filesystem filled up and
emptied again; records on that tier corrupted while it serves (bit flips, truncation);
the shared store (Mooncake) killed and restarted under both servers; a burst of requests
sent at once. Each window records what it did and what its own checks found; its cost in
requests comes from ``soak_windows``.

Probes with fresh chunks (passages with a tag nobody else sends, tokenized up front) run
alone on the server (``Quiesce.alone``), so the metrics they read are theirs.
"""

from __future__ import annotations

import os
import random
import resource
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from soak_sampler import label
from soak_server import DiskScan, ServerManager, scan_disk
from soak_traffic import Client, Traffic
from soak_windows import Window

STORE_ERRORS = "sgl_pic_store_errors_total"
UNREACHABLE = "sgl_pic_shared_store_unreachable_total"
STORE_UP = "sgl_pic_shared_store_up"
# The burst's requests: valid kinds only, so every one must be answered.
BURST_KINDS = ("plain", "chunked", "chat", "chat_tools")
FILLER = "soak_filler.bin"
SETTLE_S = 120.0  # longest wait for a fault's after-effect (a write, a reconnection)


def errors_of(m: dict[str, float], kinds: tuple[str, ...]) -> float:
    """The store errors of ``kinds`` counted in /metrics reading ``m``."""
    return sum(
        v for k, v in m.items() if k.startswith(STORE_ERRORS + "{") and label(k, "kind") in kinds
    )


def wait_until(check: Any, timeout_s: float) -> float | None:
    """Seconds until ``check()`` held (polled every half second), None if it never did."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if check():
                return round(time.monotonic() - t0, 2)
        except (requests.RequestException, OSError):
            pass
        time.sleep(0.5)
    return None


@dataclass
class Faults:
    """Injects the faults into ``traffic``'s servers (a: ``servers[0]``, with the disk
    tier on ``mount``; ``store``: the shared store service or None)."""

    traffic: Traffic
    mount: Path | None  # the small filesystem server a's disk tier lives on (None: none)
    store: Any  # sgl_pic.store.shared.service.SharedStoreService | None
    probes: list[tuple[list[int], list[list[int]]]]  # fresh prompts: ids, chunk spans
    windows: list[Window] = field(default_factory=list)
    scans: dict[str, DiskScan] = field(default_factory=dict)
    store_starts: list[float] = field(default_factory=list)  # when the store (re)started
    _emptied: threading.Event = field(default_factory=threading.Event)  # ends the filler
    _probe_next: int = 0

    @property
    def a(self) -> ServerManager:
        return self.traffic.servers[0]

    def open(self, name: str, servers: tuple[str, ...]) -> Window:
        w = Window(name, self.traffic.now(), servers)
        self.windows.append(w)
        print(f"[{w.start:7.1f} s] window {name} begins", flush=True)
        return w

    def shut(self, w: Window) -> None:
        w.close(self.traffic.now())
        print(f"[{w.end:7.1f} s] window {w.name} ends: ok={w.ok} {w.checks}", flush=True)

    def fresh(self, server: ServerManager, times: int = 2) -> tuple[list[int], list[int]]:
        """A fresh-chunk prompt sent ``times`` times (twice: store admission may wait for
        a second sight), alone on ``server``: its (ids, greedy output ids of the last
        answer)."""
        ids, spans = self.probes[self._probe_next % len(self.probes)]
        self._probe_next += 1
        body = {
            "input_ids": ids,
            "pic": {"chunks": spans, "config": {"policy": "full_reuse"}},
            "sampling_params": {"temperature": 0, "max_new_tokens": 8},
        }
        out: list[int] = []
        for _ in range(times):
            r = requests.post(server.url + "/generate", json=body, timeout=300)
            r.raise_for_status()
            out = list(r.json()["output_ids"])
        return ids, out

    # ---------------------------------------------------------------- the faults

    def burst(self, n: int) -> Window:
        """``n`` valid requests at once (one thread each), to both servers."""
        tr = self.traffic
        w = self.open("burst", tuple(s.name for s in tr.servers))
        rng = random.Random(n)
        clients = [Client(10_000 + i, tr, tr.args.seed) for i in range(n)]

        def one(c: Client) -> None:
            c.server = rng.choice(tr.servers)
            rec = c.send(rng.choice(BURST_KINDS))
            tr.add(rec._replace(kind="burst:" + rec.kind))

        with ThreadPoolExecutor(n) as pool:
            list(pool.map(one, clients))
        mine = [r for r in tr.records if r.kind.startswith("burst:") and r.t >= w.start]
        w.checks = {"sent": n, "answered": sum(r.outcome == "ok" for r in mine)}
        w.ok = w.checks["answered"] == n
        self.shut(w)
        return w

    def disk_full(self, hold_s: float) -> Window:
        """Server a's disk tier filesystem filled to the last byte for ``hold_s`` seconds
        (a fresh-chunk probe makes a write meet it), then emptied; a second probe must be
        written again. Without a mount of its own, the processes' file size limit is
        lowered instead (RLIMIT_FSIZE: writes fail with EFBIG, counted as enospc)."""
        a = self.a
        w = self.open("disk_full", (a.name,))
        before = errors_of(a.metrics(), ("enospc",))
        how = self._fill() if self.mount is not None else self._limit(1 << 20)
        w.detail = {"how": how}
        with self.traffic.quiesce.alone():
            self.fresh(a)
        time.sleep(hold_s)
        counted = wait_until(lambda: errors_of(a.metrics(), ("enospc",)) > before, SETTLE_S)
        self._unfill() if self.mount is not None else self._limit(resource.RLIM_INFINITY)
        w.close(self.traffic.now())
        assert a.disk is not None
        files0 = {p.name for p in a.disk.rglob("*.sglkv")}
        with self.traffic.quiesce.alone():
            self.fresh(a)
        resumed = wait_until(
            lambda: bool({p.name for p in a.disk.rglob("*.sglkv")} - files0), SETTLE_S
        )
        w.checks = {
            "enospc_counted": errors_of(a.metrics(), ("enospc",)) - before,
            "counted_after_s": counted,
            # Seconds from the second probe's answer until its record was on disk.
            "written_again_after_probe_s": resumed,
        }
        w.ok = counted is not None and resumed is not None
        print(f"[{w.end:7.1f} s] window disk_full ended: ok={w.ok} {w.checks}", flush=True)
        return w

    def _fill(self) -> str:
        """Fills the mount, and keeps it full until ``_unfill``: the server's own
        deletions and evictions free space, which the filler takes again at once."""
        assert self.mount is not None
        self._full = threading.Event()
        self._filler = threading.Thread(target=self._keep_full, name="filler", daemon=True)
        self._filler.start()
        self._full.wait(60.0)
        free = os.statvfs(self.mount).f_bavail
        size = (self.mount / FILLER).stat().st_size
        return f"filled {self.mount} with {size} bytes, kept full; {free} blocks free"

    def _keep_full(self) -> None:
        assert self.mount is not None
        block = b"\0" * (64 << 10)
        with open(self.mount / FILLER, "wb", buffering=0) as f:
            while not self._emptied.is_set():
                try:
                    while f.write(block):
                        pass
                except OSError:
                    self._full.set()
                self._emptied.wait(0.05)

    def _unfill(self) -> None:
        assert self.mount is not None
        self._emptied.set()
        self._filler.join()
        (self.mount / FILLER).unlink(missing_ok=True)
        self._emptied.clear()

    def _limit(self, size: int) -> str:
        from soak_sampler import group_pids

        for pid in group_pids(self.a.pid):
            try:
                resource.prlimit(pid, resource.RLIMIT_FSIZE, (size, size))
            except (OSError, ValueError):
                continue
        return f"RLIMIT_FSIZE {size} on process group {self.a.pid}"

    def prepare_corruption(self) -> dict[str, Any]:
        """Before the kill: a fresh-chunk probe on a, and the record files it added."""
        a = self.a
        assert a.disk is not None
        with self.traffic.quiesce.alone():
            files0 = {p for p in a.disk.rglob("*.sglkv")}
            ids, out = self.fresh(a)
            wait_until(lambda: len(set(a.disk.rglob("*.sglkv")) - files0) >= 2, SETTLE_S)
            new = sorted(set(a.disk.rglob("*.sglkv")) - files0)
        return {"ids": ids, "output": out, "files": new}

    def kill9(self) -> Window:
        """SIGKILL to server a's process group; the disk tier scanned before and after;
        a restarted on it. The window ends when a answers /health again."""
        a = self.a
        assert a.disk is not None
        with a.lifecycle, self.traffic.deleting:
            self.scans["before_kill"] = scan_disk(a.disk, self.traffic.now())
            # Opened once the locks are held: a tenant probe may hold them for a while.
            w = self.open("kill9", (a.name,))
            a.kill9(planned=True)
            a.event("killed", f"SIGKILL to process group {a.pid}")
            # Before the restart: start-up deletes bad files and old temp files.
            after = self.scans["after_kill"] = scan_disk(a.disk, self.traffic.now())
            restarted = a.restart()
        before = self.scans["before_kill"]
        lost = sorted(before.valid - after.valid)
        w.checks = {
            "restarted": restarted,
            "lost": len(lost),
            "lost_files": lost[:20],
            "corrupt_after_kill": len(after.bad),
            "tmp_files_after_kill": len(after.tmp_files),
            "store_errors_at_restart": a.metrics((STORE_ERRORS,)) if restarted else {},
        }
        w.ok = restarted and not lost and not after.bad
        self.shut(w)
        return w

    def corrupt(self, prepared: dict[str, Any], extra: float) -> Window:
        """Records of server a corrupted while it serves: the prepared probe's files (bit
        flips in every payload block of layer 0's K, or truncation, alternately) and a
        share ``extra`` of the other valid files. The probe sent again must be answered
        as before, with the damage counted; its files must then be gone or whole."""
        from sgl_pic.store.format import read_header

        a = self.a
        assert a.disk is not None
        w = self.open("corrupt", (a.name,))
        targets = [p for p in prepared["files"] if p.exists()]
        present = len(targets)  # the probe's files still on disk when it strikes
        others = sorted(set(a.disk.rglob("*.sglkv")) - set(targets))
        rng = random.Random(len(others))
        targets += rng.sample(others, max(1, int(extra * len(others)))) if others else []
        how: dict[str, str] = {}
        for i, path in enumerate(targets):
            try:
                h = read_header(path)
                with open(path, "r+b") as f:
                    if i % 2:
                        f.truncate(h.data_offset + (path.stat().st_size - h.data_offset) // 2)
                        how[path.name] = "truncated"
                        continue
                    for first in range(0, h.num_tokens, h.block_tokens):
                        f.seek(h.data_offset + first * h.row_bytes)
                        byte = f.read(1)
                        f.seek(-1, os.SEEK_CUR)
                        f.write(bytes([byte[0] ^ 0xFF]))
                    how[path.name] = "bit_flips"
            except (OSError, ValueError) as e:
                how[path.name] = f"skipped: {type(e).__name__}"
        w.detail = {
            "corrupted": len(how),
            "probe_files": len(prepared["files"]),
            "probe_files_present": present,
            "how": how,
        }
        kinds = ("corrupt", "truncated")
        with self.traffic.quiesce.alone():
            before = errors_of(a.metrics(), kinds)
            out = self._resend(a, prepared["ids"])
        # The count reaches /metrics with a's next batch: the traffic, running again, sends it.
        counted = wait_until(lambda: errors_of(a.metrics(), kinds) > before, SETTLE_S)
        scan = scan_disk(a.disk, self.traffic.now())
        still_bad = [p.name for p in prepared["files"] if str(p.relative_to(a.disk)) in scan.bad]
        w.checks = {
            "same_output": out == prepared["output"],
            "damage_counted": errors_of(a.metrics(), kinds) - before,
            "counted_after_s": counted,
            "probe_files_still_bad": len(still_bad),
            "bad_on_disk_now": len(scan.bad),
        }
        w.ok = out == prepared["output"] and counted is not None and not still_bad
        self.shut(w)
        return w

    def _resend(self, server: ServerManager, ids: list[int]) -> list[int]:
        spans = next(s for i, s in self.probes if i == ids)
        body = {
            "input_ids": ids,
            "pic": {"chunks": spans, "config": {"policy": "full_reuse"}},
            "sampling_params": {"temperature": 0, "max_new_tokens": 8},
        }
        r = requests.post(server.url + "/generate", json=body, timeout=300)
        r.raise_for_status()
        return list(r.json()["output_ids"])

    def store_kill(self, hold_s: float) -> Window:
        """The shared store SIGKILLed under both servers, started again (empty) after
        ``hold_s``; a fresh-chunk request to each meanwhile makes it meet the outage. Both
        must count it, keep serving, and report the store up again."""
        tr = self.traffic
        w = self.open("store_kill", tuple(s.name for s in tr.servers))
        unreachable0 = {s.name: s.metrics().get(UNREACHABLE, 0.0) for s in tr.servers}
        self.store.kill()
        t0 = time.monotonic()
        with tr.quiesce.alone():
            for s in tr.servers:
                self.fresh(s, times=1)
        time.sleep(max(0.0, hold_s - (time.monotonic() - t0)))
        self.store.start()
        self.store_starts.append(self.traffic.now())
        w.detail = {"held_s": round(time.monotonic() - t0, 2)}

        def counted() -> dict[str, float]:
            return {
                s.name: s.metrics().get(UNREACHABLE, 0.0) - unreachable0[s.name] for s in tr.servers
            }

        # The counter reaches /metrics with a server's next batch: the traffic sends it.
        seen = wait_until(lambda: all(v >= 1 for v in counted().values()), SETTLE_S)
        back = wait_until(
            lambda: all(s.metrics().get(STORE_UP, 0.0) == 1.0 for s in tr.servers), SETTLE_S
        )
        w.checks = {
            "unreachable_counted": counted(),
            "counted_after_s": seen,
            "store_up_again_after_s": back,
        }
        w.ok = back is not None and seen is not None
        self.shut(w)
        return w
