"""How fast people hear: health change to webhook arrival, and preflight with and without
fresh results on the local 3x2 gloo cluster. Real server process, real notifier, real Ray."""

from __future__ import annotations

import os
import statistics
import threading
import time
import uuid
from pathlib import Path

import httpx
from cryptography.fernet import Fernet

from bench import admin_url
from ringwatch.services.notifier.receiver import WebhookReceiver
from ringwatch.services.scheduler.api_client import SchedulerApi
from ringwatch.services.scheduler.cycle import ProbeOptions, run_cycle, serve_preflight
from ringwatch.services.scheduler.ray_backend import RayBackend
from ringwatch.services.scheduler.shipper import Shipper
from ringwatch.services.store import db
from tests.api_fixtures import fleet_batch
from tests.procs import free_port, start_server, stop_server

SECRET = "bench-secret-123"
TOKEN = "rw_bench_" + uuid.uuid4().hex


def main(flags: list[str]) -> None:
    state = Path(".ringwatch") / f"bench-{os.getpid()}"
    admin = admin_url()
    name = f"rw_bench_{uuid.uuid4().hex[:8]}"
    url = db.create_database(admin, name)
    db.upgrade(url)
    # The receiver listens on loopback, which webhooks may reach only when allowed; their
    # secrets are stored encrypted under a key made for this run.
    env = {**os.environ, "RINGWATCH_DATABASE_URL": url, "RINGWATCH_BOOTSTRAP_ADMIN_TOKEN": TOKEN,
           "RINGWATCH_API_URL": f"http://127.0.0.1:{free_port()}", "RINGWATCH_STATE_DIR": str(state),
           "RINGWATCH_SECRET_KEY": Fernet.generate_key().decode(),
           "RINGWATCH_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.1/32"}
    proc = start_server(env, notifier=True)
    try:
        api = env["RINGWATCH_API_URL"]
        webhook_latency(api)
        preflight_times(api, state)
    finally:
        stop_server(proc)
        db.drop_database(admin, name)


def webhook_latency(api: str, samples: int = 10) -> None:
    h = {"Authorization": f"Bearer {TOKEN}"}
    with WebhookReceiver(SECRET) as rx, httpx.Client(base_url=api, headers=h) as c:
        c.post("/v1/webhooks", json={"url": rx.url, "secret": SECRET,
                                     "events": ["health.degraded"]}).raise_for_status()
        lat = []
        for i in range(samples):
            # A fleet of its own, so the preflight below sees only the real cluster's results.
            c.post("/v1/measurements", json=fleet_batch(prefix="hook")).raise_for_status()
            before = len(rx.events)
            t0 = time.monotonic()
            r = c.post("/v1/measurements",
                       json=fleet_batch(slow_node=f"hook-00{i % 4}", prefix="hook")).json()
            rx.wait_for(before + len(r["degraded"]), timeout_s=30)
            lat.append(time.monotonic() - t0)
        print(f"health change -> webhook arrival (notifier woken by LISTEN/NOTIFY, {samples} samples): "
              f"median {statistics.median(lat):.2f} s, max {max(lat):.2f} s")


def preflight_times(api: str, state: Path) -> None:
    h = {"Authorization": f"Bearer {TOKEN}"}
    options = ProbeOptions(sizes=(1 << 16, 1 << 22), warmup=3, iters=10)
    with RayBackend("gloo", local_nodes=3, ranks_per_node=2, temp_dir=state / "ray",
                    repeats=3) as backend:
        shipper = Shipper(api, TOKEN, state / "spool")
        sched = SchedulerApi(api, TOKEN, worker="bench")
        nodes = sorted({r.node for r in backend.ranks()})
        # Two cycles, as a running scheduler would have: stored verdicts judge each link
        # by the better of its last two results.
        for _ in range(2):
            shipper.ship(run_cycle(backend, options).to_batch())

        t0 = time.monotonic()
        v = httpx.post(f"{api}/v1/preflight", json={"nodes": nodes}, headers=h, timeout=60).json()
        fresh = time.monotonic() - t0
        print(f"preflight 3x2, fresh results: {fresh * 1000:.0f} ms ({v['status']}, healthy={v['healthy']}, "
              f"exclude={v['exclude']}, {[f['kind'] for f in v['findings']]})")

        stop = threading.Event()

        def scheduler() -> None:
            while not stop.is_set():
                if not serve_preflight(backend, shipper, sched, options):
                    stop.wait(0.2)

        t = threading.Thread(target=scheduler)
        t.start()
        t0 = time.monotonic()
        v = httpx.post(f"{api}/v1/preflight?wait=120", json={"nodes": nodes, "max_age_s": 0.001},
                       headers=h, timeout=180).json()
        probed = time.monotonic() - t0
        stop.set()
        t.join()
        print(f"preflight 3x2, probing now:   {probed:.2f} s ({v['status']}, healthy={v.get('healthy')})")
        shipper.close()
        sched.close()
