#!/usr/bin/env python3
"""Starts the real binaries with the manifests' own arguments and calls every probe.

    probe_binaries.py --plan PLAN.json --bin-dir target/debug [--timeout 60]

PLAN.json comes from check_manifests.py --probe-plan: for each overlay, the
etcd, prism-head, prism-worker and prism-router containers with their args,
env and HTTP probes. For each overlay this script starts a small cluster on
loopback (one etcd member, the head, every worker pool, the router), the
containers' args rewritten only where Kubernetes would differ:

  * listen addresses `0.0.0.0:PORT` become `127.0.0.1:FREE` (the port map is
    kept, so a probe on container port PORT is sent to FREE: a probe on a
    port the binary does not listen on fails);
  * Service names (`prism-head:50050`, `etcd-N.etcd:2379`) become the
    loopback address of the process started for them;
  * `$(VAR)` is expanded from the container's env, with the downward API
    values a pod would get (pod name, pod IP 127.0.0.1, a zone label);
  * the mTLS Secret the manifests mount (PRISM_TLS_CERT/KEY/CA) is made here
    with openssl: a CA and a certificate naming PRISM_TLS_SERVER_NAME, so the
    components talk mutual TLS as they would in the cluster.

Then every probe path is requested until it answers. Liveness and startup
probes must answer 200; readiness probes must answer 200 (etcd, head =
leader, worker = registered with no replica yet) or, for the router, 200 or
503 (ready only once a model replica is Ready, and none is deployed here).
A 404 or a closed port fails. Then the KEDA ScaledObject's queries are run
(scripts/keda_query.py) on the workers' real /metrics: each vLLM metric they
name must be exported, and each must give KEDA a number.
Exit status 0 when every check passed.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START_ORDER = ["etcd", "prism-head", "prism-worker", "prism-router"]
REPO = Path(__file__).resolve().parents[2]


def load_keda_query():
    """scripts/keda_query.py as a module."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("keda_query", REPO / "scripts/keda_query.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["keda_query"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def check_keda_on_workers(overlay: str, texts: list[str]) -> list[str]:
    """The ScaledObject's queries on the workers' real /metrics: every metric they name is
    declared by the workers, and KEDA would get a number (no query error)."""
    kq = load_keda_query()
    so = kq.load_scaledobject(REPO / "k8s/components/keda/scaledobject.yaml")
    declared = {line.split()[2] for t in texts for line in t.splitlines() if line.startswith("# TYPE ")}
    samples = []
    for n, text in enumerate(texts):
        samples += kq.parse_exposition(text, {"namespace": "prism", "pod": f"worker-{n}"})
    failures = []
    for trigger in so["spec"]["triggers"]:
        query = trigger["metadata"]["query"]
        what = f"{overlay} KEDA trigger {trigger.get('name')} {query}"
        for metric in re.findall(r"vllm:[a-z_]+", query):
            if metric not in declared:
                failures.append(f"{what}: the workers do not export {metric}")
        try:
            value = kq.keda_value(query, samples)
            print(f"ok   {what}: KEDA would read {value:g} from {len(texts)} idle worker(s)")
        except kq.QueryError as err:
            failures.append(f"{what}: {err}")
    return failures


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read(300).decode("utf-8", "replace").strip()
    finally:
        conn.close()


def expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), text)


class Cluster:
    """The processes of one overlay, their port maps and logs."""

    def __init__(self, workdir: Path, bin_dir: Path) -> None:
        self.workdir = workdir
        self.bin_dir = bin_dir
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []
        self.head_grpc: int | None = None
        self.etcd_client: int | None = None
        self.tls: dict[str, str] | None = None

    def tls_files(self, server_name: str) -> dict[str, str]:
        """The mounted Secret's files (ca.crt, tls.crt, tls.key), made once per cluster."""
        if self.tls is None:
            d = self.workdir / "tls"
            d.mkdir()
            ossl = lambda *a: subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True)
            ossl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=probe-ca")
            ossl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", "tls.key", "-out", "tls.csr", "-subj", f"/CN={server_name}")
            (d / "ext.cnf").write_text(f"subjectAltName=DNS:{server_name},DNS:localhost,IP:127.0.0.1\n")
            ossl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", "tls.crt", "-days", "1", "-extfile", "ext.cnf")
            self.tls = {"PRISM_TLS_CERT": str(d / "tls.crt"), "PRISM_TLS_KEY": str(d / "tls.key"),
                        "PRISM_TLS_CA": str(d / "ca.crt")}
        return self.tls

    def pod_env(self, entry: dict, name: str) -> dict[str, str]:
        env: dict[str, str] = {}
        downward = {"metadata.name": name, "status.podIP": "127.0.0.1"}
        for key, value in entry["env"].items():
            if isinstance(value, dict):
                field = value["fieldRef"]
                env[key] = downward.get(field, "probe-zone" if "zone" in field else "")
            else:
                env[key] = expand(value, env)
        if "PRISM_TLS_CERT" in env:
            env.update(self.tls_files(env.get("PRISM_TLS_SERVER_NAME") or "localhost"))
        return env

    def rewrite(self, binary: str, args: list[str], env: dict[str, str]) -> tuple[list[str], dict[int, int]]:
        ports: dict[int, int] = {}
        out = []
        for arg in args:
            arg = expand(arg, env)
            m = re.fullmatch(r"(--[\w-]+)=0\.0\.0\.0:(\d+)", arg)
            if m:
                ports[int(m.group(2))] = free_port()
                arg = f"{m.group(1)}=127.0.0.1:{ports[int(m.group(2))]}"
            elif arg.startswith("--store=etcd://"):
                arg = f"--store=etcd://127.0.0.1:{self.etcd_client}"
            elif arg.startswith("--head="):
                arg = f"--head=http://127.0.0.1:{self.head_grpc}"
            out.append(arg)
        # Addresses this process advertises name its own (remapped) ports.
        out = [re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{ports.get(int(m.group(1)), int(m.group(1)))}", a)
               for a in out]
        if binary == "prism-head":
            self.head_grpc = ports.get(50050)
        return out, ports

    def start_etcd(self, entry: dict) -> dict[int, int]:
        env = self.pod_env(entry, "etcd-0")
        ports: dict[int, int] = {}
        for key in ("ETCD_LISTEN_CLIENT_URLS", "ETCD_LISTEN_PEER_URLS", "ETCD_LISTEN_METRICS_URLS"):
            port = int(env[key].rsplit(":", 1)[1])
            ports[port] = free_port()
            env[key] = f"http://127.0.0.1:{ports[port]}"
        client = env["ETCD_LISTEN_CLIENT_URLS"]
        peer = env["ETCD_LISTEN_PEER_URLS"]
        env.update({"ETCD_NAME": "probe", "ETCD_DATA_DIR": str(self.workdir / "etcd"),
                    "ETCD_ADVERTISE_CLIENT_URLS": client, "ETCD_INITIAL_ADVERTISE_PEER_URLS": peer,
                    "ETCD_INITIAL_CLUSTER": f"probe={peer}"})
        self.etcd_client = ports[2379]
        self.spawn("etcd", ["etcd"], env)
        return ports

    def spawn(self, label: str, cmd: list[str], env: dict[str, str]) -> None:
        log = self.workdir / f"{label}.log"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PRISM_", "ETCD_"))}
        full_env.update(env)
        proc = subprocess.Popen(cmd, env=full_env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append((label, proc, log))

    def start(self, entry: dict, index: int) -> dict[int, int]:
        binary = entry["binary"]
        if binary == "etcd":
            return self.start_etcd(entry)
        env = self.pod_env(entry, f"{binary}-{index}")
        args, ports = self.rewrite(binary, entry["args"], env)
        path = self.bin_dir / binary
        self.spawn(f"{binary}-{index}", [str(path), *args], env)
        return ports

    def alive(self, label: str) -> bool:
        return all(p.poll() is None for name, p, _ in self.procs if name == label)

    def stop(self) -> None:
        for _, proc, _ in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for _, proc, _ in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def logs(self) -> str:
        return "\n".join(f"--- {name} (exit {p.poll()})\n{log.read_text(errors='replace')[-2000:]}"
                         for name, p, log in self.procs)


def wait_probe(port: int, path: str, accept: set[int], timeout: float, alive) -> tuple[bool, str]:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if not alive():
            return False, f"process exited ({last})"
        try:
            status, body = http_get(port, path)
            last = f"HTTP {status} {body[:80]!r}"
            if status in accept:
                return True, last
            if status == 404:
                return False, last
        except OSError as err:
            last = f"{type(err).__name__}: {err}"
        time.sleep(0.2)
    return False, f"timed out after {timeout:.0f}s, last: {last}"


def run_overlay(overlay: str, entries: list[dict], bin_dir: Path, timeout: float) -> list[str]:
    failures = []
    entries = sorted(entries, key=lambda e: START_ORDER.index(e["binary"]))
    with tempfile.TemporaryDirectory(prefix=f"prism-probes-{overlay}-") as tmp:
        cluster = Cluster(Path(tmp), bin_dir)
        try:
            started = []
            for i, entry in enumerate(entries):
                ports = cluster.start(entry, i)
                label = cluster.procs[-1][0]
                started.append((entry, ports, label))
                # Later processes need the earlier ones serving (etcd, then the head).
                for probe in entry["probes"]:
                    if probe["kind"] == "livenessProbe" and probe["port"] in ports:
                        wait_probe(ports[probe["port"]], probe["path"], {200}, timeout,
                                   lambda label=label: cluster.alive(label))
            for entry, ports, label in started:
                for probe in entry["probes"]:
                    what = f"{overlay} {entry['workload']} {probe['kind']} :{probe['port']}{probe['path']}"
                    if probe["port"] not in ports:
                        failures.append(f"{what}: {entry['binary']} listens on no such port (has {sorted(ports)})")
                        continue
                    accept = {200}
                    if probe["kind"] == "readinessProbe" and entry["binary"] == "prism-router":
                        accept = {200, 503}
                    ok, detail = wait_probe(ports[probe["port"]], probe["path"], accept, timeout,
                                            lambda label=label: cluster.alive(label))
                    print(f"{'ok  ' if ok else 'FAIL'} {what}: {detail}")
                    if not ok:
                        failures.append(f"{what}: {detail}")
            texts = []
            for entry, ports, _ in started:
                if entry["binary"] == "prism-worker" and 8082 in ports:
                    conn = http.client.HTTPConnection("127.0.0.1", ports[8082], timeout=3)
                    conn.request("GET", "/metrics")
                    texts.append(conn.getresponse().read().decode("utf-8", "replace"))
                    conn.close()
            if texts:
                failures += check_keda_on_workers(overlay, texts)
        finally:
            cluster.stop()
            if failures:
                print(cluster.logs())
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", type=Path, required=True)
    ap.add_argument("--bin-dir", type=Path, required=True)
    ap.add_argument("--timeout", type=float, default=60.0)
    opts = ap.parse_args()
    plan = json.loads(opts.plan.read_text())
    missing = sorted({e["binary"] for e in plan if e["binary"] != "etcd" and not (opts.bin_dir / e["binary"]).exists()})
    if missing:
        print(f"FAIL binaries not built: {', '.join(missing)} (in {opts.bin_dir})")
        return 2
    failures = []
    for overlay in sorted({e["overlay"] for e in plan}):
        failures += run_overlay(overlay, [e for e in plan if e["overlay"] == overlay], opts.bin_dir, opts.timeout)
    probes = sum(len(e["probes"]) for e in plan)
    print(f"probes: {probes - len(failures)} ok, {len(failures)} failing")
    for f in failures:
        print(f"FAIL {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
