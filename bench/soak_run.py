"""The soak's run state (``bench/soak.py``): the servers and the shared store, the
clients, the canary on each server, the tenant probe, the crash watcher, the sampler and
the fault schedule."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import requests
from soak_concurrency import Choice, Level, choose, level, saturated
from soak_faults import Faults
from soak_sampler import Sample, Sampler, Target
from soak_server import ServerEvent, ServerManager
from soak_tenants import ProbeResult, probe
from soak_traffic import Client, Traffic

LOGPROB_TOL = 1e-4
STORE_PROCESSES = ("mooncake_master", "mooncake_client")


class CanaryCheck(NamedTuple):
    t: float
    server: str
    outcome: str  # match | mismatch | unavailable | error
    detail: str


def store_targets(generation: int) -> list[Target]:
    """The shared store's processes (each leads its own group), found by name;
    ``generation``: the store's launch."""
    import os

    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                continue
            if comm in STORE_PROCESSES:
                name = comm.replace("mooncake_", "store_")
                out.append(Target(name, int(entry), None, None, generation))
    return out


class Soak:
    """The run: ``servers`` (a first), their clients and checks."""

    def __init__(self, args: argparse.Namespace, traffic: Traffic, faults: Faults) -> None:
        self.args = args
        self.traffic = traffic
        self.faults = faults
        self.servers = traffic.servers
        self.events: list[ServerEvent] = []
        self.canary: list[CanaryCheck] = []
        self.probes: list[ProbeResult] = []
        self.reference: dict[str, tuple[list[int], list[float]]] = {}
        self.crashes = 0
        self._lock = threading.Lock()
        self.sampler = Sampler(self.targets, traffic.now, args.sample_every)
        self.ramp: list[Level] = []
        self.clients_t = 0.0  # when the soak's clients began and ended (run())
        self.clients_end_t = 0.0
        self.choice: Choice | None = None

    def targets(self) -> list[Target]:
        out = [
            Target(s.name, s.pid if s.up.is_set() else None, s.url, s.disk, s.generation)
            for s in self.servers
            if s.up.is_set()
        ]
        if self.faults.store is None:
            return out
        return out + store_targets(len(self.faults.store_starts))

    def starts(self) -> dict[tuple[str, int], float]:
        """When each server and store launch began serving."""
        out = {(s.name, g): t for s in self.servers for g, t in s.started_at.items()}
        for name in STORE_PROCESSES:
            for g, t in enumerate(self.faults.store_starts, 1):
                out[(name.replace("mooncake_", "store_"), g)] = t
        return out

    # ------------------------------------------------------------------ the canary

    def canary_body(self) -> dict[str, Any]:
        return {
            "input_ids": self.traffic.workload.canary_ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": 8},
            "return_logprob": True,
        }

    def send_canary(self, server: ServerManager) -> tuple[list[int], list[float]]:
        r = requests.post(
            server.url + "/generate", json=self.canary_body(), timeout=self.args.timeout
        )
        if r.status_code != 200:
            raise RuntimeError(f"canary answered {r.status_code}: {r.text[:300]}")
        lp = r.json()["meta_info"]["output_token_logprobs"]
        return [int(x[1]) for x in lp], [float(x[0]) for x in lp]

    def check_canary(self, server: ServerManager) -> CanaryCheck:
        gen, up = server.generation, server.up.is_set()
        t = self.traffic.now()
        try:
            tokens, logprobs = self.send_canary(server)
        except requests.RequestException as e:
            outcome = "unavailable" if Traffic.outage(server, gen, up) else "error"
            return CanaryCheck(t, server.name, outcome, f"{type(e).__name__}: {str(e)[:200]}")
        except RuntimeError as e:
            return CanaryCheck(t, server.name, "error", str(e))
        ref_tokens, ref_lp = self.reference[server.name]
        if tokens != ref_tokens:
            detail = f"tokens {tokens} != reference {ref_tokens}"
            return CanaryCheck(t, server.name, "mismatch", detail)
        worst = max(abs(a - b) for a, b in zip(logprobs, ref_lp, strict=True))
        if not worst <= LOGPROB_TOL:
            return CanaryCheck(t, server.name, "mismatch", f"logprobs differ by {worst:.3g}")
        return CanaryCheck(t, server.name, "match", f"max logprob diff {worst:.2g}")

    def _sleep_until(self, end: float) -> None:
        while time.monotonic() < min(end, self.traffic.deadline):
            time.sleep(0.5)

    def canary_loop(self) -> None:
        while time.monotonic() < self.traffic.deadline:
            for server in self.servers:
                check = self.check_canary(server)
                with self._lock:
                    self.canary.append(check)
                if check.outcome == "mismatch":
                    print(f"[{check.t:7.1f} s] CANARY MISMATCH {server.name}: {check.detail}")
            self._sleep_until(time.monotonic() + self.args.canary_every)

    def probe_loop(self) -> None:
        """The tenant probe on server a every ``--tenant-probe-every`` seconds."""
        tr, a = self.traffic, self.servers[0]
        texts = [p.text for p in tr.workload.passages]
        n = 0
        while time.monotonic() < tr.deadline:
            self._sleep_until(time.monotonic() + self.args.tenant_probe_every)
            if time.monotonic() >= tr.deadline or not a.up.is_set():
                continue
            n += 1
            with tr.deleting, tr.quiesce.alone():
                result = probe(
                    a.url,
                    n,
                    tr.workload.ids,
                    texts,
                    tr.workload.tails[0],
                    self.args.timeout,
                    tr.now(),
                )
            with self._lock:
                self.probes.append(result)
            if result.outcome != "ok":
                print(f"[{result.t:7.1f} s] tenant probe: {result.outcome} {result.detail}")

    def watch(self, stop: threading.Event) -> None:
        """Restart a server that dies outside a planned kill (a crash)."""
        while not stop.wait(1.0):
            for s in self.servers:
                with s.lifecycle:
                    if s.up.is_set() and not s.alive():
                        self.crashes += 1
                        s.event("crashed", "died unplanned; log tail:\n" + s.log_tail(30))
                        s.kill9(planned=False)
                        if time.monotonic() < self.traffic.deadline:
                            s.restart()

    # ------------------------------------------------------------------- the run

    def find_concurrency(self, levels: list[int], seconds: float) -> Choice:
        """The mix at each of ``levels`` clients for ``seconds``, until saturated; their
        records are kept apart from the soak's."""
        tr = self.traffic
        for n in levels:
            kept, tr.records = tr.records, []
            t0 = time.monotonic()
            tr.deadline = t0 + seconds
            self._clients(n, offset=1000 * (len(self.ramp) + 1), join=True)
            self.ramp.append(level(n, time.monotonic() - t0, tr.records))
            tr.records = kept
            why = saturated(self.ramp)
            print(f"ramp: {self.ramp[-1]}" + (f"; saturated: {why}" if why else ""), flush=True)
            if why:
                break
        self.choice = choose(self.ramp)
        print(f"concurrency chosen: {self.choice.reason}", flush=True)
        return self.choice

    def _clients(self, n: int, offset: int = 0, join: bool = False) -> list[threading.Thread]:
        threads = [
            threading.Thread(
                target=Client(offset + i, self.traffic, self.args.seed).loop,
                name=f"client{offset + i}",
                daemon=True,
            )
            for i in range(n)
        ]
        for t in threads:
            t.start()
        if join:
            for t in threads:
                t.join()
        return threads

    def run(
        self, clients: int, seconds: float, schedule: list[tuple[float, Callable[[], Any]]]
    ) -> None:
        """``clients`` for ``seconds`` at least, the faults of ``schedule`` ((share of the
        run, fault) pairs, in order) injected meanwhile; clients stop once the time is up
        and every fault is over."""
        tr = self.traffic
        self.clients_t = tr.now()
        t0 = time.monotonic()
        tr.deadline = float("inf")
        stop = threading.Event()
        threads = self._clients(clients)
        threads.append(threading.Thread(target=self.canary_loop, name="canary", daemon=True))
        if self.args.tenants >= 2:
            threads.append(threading.Thread(target=self.probe_loop, name="probe", daemon=True))
        watcher = threading.Thread(target=self.watch, args=(stop,), daemon=True)
        for t in threads[clients:] + [watcher]:
            t.start()
        for share, fault in schedule:
            time.sleep(max(0.0, t0 + share * seconds - time.monotonic()))
            fault()
        tr.deadline = max(t0 + seconds, time.monotonic() + self.args.settle)
        self._until_answered(t0)
        for t in threads:
            t.join()
        stop.set()
        watcher.join()
        self.clients_end_t = tr.now()

    def answered_after_warmup(self) -> int:
        """Requests answered 200 that were sent after the clients' warm-up."""
        since = self.clients_t + self.args.warmup_minutes * 60
        return sum(r.outcome == "ok" and r.t >= since for r in self.traffic.records)

    def _until_answered(self, t0: float) -> None:
        """With ``--until-answered N``: the clients go on past the deadline until N requests
        were answered after warm-up, or ``--max-minutes`` from their start."""
        tr, want = self.traffic, self.args.until_answered
        if not want:
            return
        cap = t0 + self.args.max_minutes * 60
        while time.monotonic() < cap and self.answered_after_warmup() < want:
            tr.deadline = max(tr.deadline, min(cap, time.monotonic() + 10.0))
            time.sleep(5.0)

    def samples(self) -> list[Sample]:
        return self.sampler.samples
