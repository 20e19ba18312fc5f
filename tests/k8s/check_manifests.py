#!/usr/bin/env python3
"""Renders every kustomize overlay under k8s/overlays and checks it.

Run by tests/tests/k8s_manifests.rs (inside the venv made by tests/k8s/setup.sh):

    check_manifests.py [--repo DIR] [--probe-plan OUT.json]

For each overlay:
  * `kubectl kustomize` renders it;
  * every core resource is validated offline against the Kubernetes JSON
    schemas (kubernetes-validate, strict: unknown fields are errors) for the
    oldest and the newest version we support;
  * custom resources (PodMonitor, ScaledObject) get structural checks;
  * every long-running container has cpu/memory requests and limits,
    liveness and readiness probes on ports it declares, and runs non-root;
  * worker StatefulSets: terminationGracePeriodSeconds >= preStop sleep +
    drain deadline (grace - margin) + margin, /dev/shm is a memory emptyDir,
    GPU requests equal limits;
  * PodDisruptionBudgets cover etcd, head, router and every worker pool, and
    at steady-state readiness each allows at least one eviction (no
    `kubectl drain` deadlock) while etcd keeps its quorum;
  * Services, PodMonitors and the KEDA ScaledObject point at things that
    exist (selectors, named ports, scale target, the vLLM metric names);
  * mutual TLS: every prism container's PRISM_TLS_CERT/KEY/CA lie in a
    mounted Secret that a cert-manager Certificate writes, Certificates name
    existing Issuers, PRISM_TLS_SERVER_NAME is in every server certificate.

With --probe-plan, writes the HTTP probes of the prism binaries and etcd
(binary, args and env as written, probe kind, port, path) for
probe_binaries.py.
Exit status 0 when everything holds; 1 with one line per problem otherwise.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

try:
    import kubernetes_validate
except ImportError:  # reported as a failure below
    kubernetes_validate = None

SCHEMA_VERSIONS = ("1.31.0", "1.37.0")
CORE_GROUPS = {"v1", "apps/v1", "batch/v1", "policy/v1", "networking.k8s.io/v1",
               "rbac.authorization.k8s.io/v1", "autoscaling/v2"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
PRISM_BINARIES = {"prism-head", "prism-worker", "prism-router", "etcd"}


class Report:
    """Collects problems; prints them all at the end."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.checks = 0

    def check(self, ok: bool, where: str, what: str) -> bool:
        self.checks += 1
        if not ok:
            self.problems.append(f"{where}: {what}")
        return ok


def render(repo: Path, overlay: Path) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(overlay)], cwd=repo,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {overlay} failed:\n{out.stderr}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def name_of(doc: dict) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def pod_spec(doc: dict) -> dict | None:
    if doc["kind"] in WORKLOADS:
        return doc["spec"]["template"]["spec"]
    return None


def pod_labels(doc: dict) -> dict:
    return doc["spec"]["template"]["metadata"].get("labels", {})


def selects(selector: dict, labels: dict) -> bool:
    match = selector.get("matchLabels", selector)
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


def seconds(text: str) -> float:
    """`60`, `60s`, `2m`, `500ms` -> seconds."""
    m = re.fullmatch(r"([0-9.]+)(ms|s|m|h)?", text.strip())
    if not m:
        raise ValueError(f"not a duration: {text!r}")
    scale = {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[m.group(2)]
    return float(m.group(1)) * scale


def flag(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
        if a == f"--{name}" and i + 1 < len(args):
            return args[i + 1]
    return None


def validate_schema(rep: Report, where: str, doc: dict) -> None:
    if kubernetes_validate is None:
        rep.check(False, where, "kubernetes-validate is not installed")
        return
    for version in SCHEMA_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
            rep.check(True, where, "")
        except kubernetes_validate.ValidationError as err:
            path = "/".join(str(p) for p in err.path)
            rep.check(False, where, f"k8s {version} schema: {err.message} at {path}")
        except kubernetes_validate.SchemaNotFoundError:
            rep.check(False, where, f"no k8s {version} schema for {doc['apiVersion']} {doc['kind']}")


def check_container(rep: Report, where: str, c: dict, pod: dict, long_running: bool) -> None:
    where = f"{where} container {c['name']}"
    res = c.get("resources", {})
    for part in ("requests", "limits"):
        for r in ("cpu", "memory"):
            rep.check(r in res.get(part, {}), where, f"no {part}.{r}")
    for r, v in res.get("limits", {}).items():
        if r.endswith("gpu"):
            rep.check(res.get("requests", {}).get(r) == v, where, f"{r} request != limit")
    sc = {**pod.get("securityContext", {}), **c.get("securityContext", {})}
    rep.check(sc.get("runAsNonRoot") is True, where, "runAsNonRoot is not true")
    rep.check(int(sc.get("runAsUser", 1)) != 0, where, "runs as uid 0")
    rep.check(sc.get("allowPrivilegeEscalation") is False, where, "allowPrivilegeEscalation is not false")
    rep.check("ALL" in sc.get("capabilities", {}).get("drop", []), where, "capabilities not dropped")
    if not long_running:
        return
    ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    for kind in ("livenessProbe", "readinessProbe"):
        rep.check(kind in c, where, f"no {kind}")
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = c.get(kind)
        if not probe:
            continue
        action = probe.get("httpGet") or probe.get("grpc") or probe.get("tcpSocket")
        if not rep.check(action is not None, where, f"{kind} has no httpGet/grpc/tcpSocket"):
            continue
        port = action.get("port")
        ok = port in ports if isinstance(port, str) else port in ports.values()
        rep.check(ok, where, f"{kind} port {port!r} is not a declared container port")


def check_worker(rep: Report, overlay: str, doc: dict) -> None:
    """Drain timing, /dev/shm and the model cache of one worker pool."""
    where = f"{overlay} {name_of(doc)}"
    spec = pod_spec(doc)
    c = next(c for c in spec["containers"] if c["name"] == "worker")
    args = c.get("args", [])
    grace = flag(args, "drain-grace")
    margin = flag(args, "drain-margin")
    if not rep.check(grace is not None and margin is not None, where, "no --drain-grace/--drain-margin"):
        return
    grace_s, margin_s = seconds(grace), seconds(margin)
    deadline = grace_s - margin_s
    rep.check(deadline > 0, where, f"drain deadline {deadline}s is not positive")
    pre = c.get("lifecycle", {}).get("preStop", {})
    pre_s = 0.0
    if "sleep" in pre:
        pre_s = float(pre["sleep"]["seconds"])
    elif "exec" in pre:
        cmd = pre["exec"]["command"]
        if Path(cmd[0]).name == "sleep":
            pre_s = seconds(cmd[1])
    rep.check(pre_s > 0, where, "no preStop sleep (route update before SIGTERM)")
    tgps = spec.get("terminationGracePeriodSeconds", 30)
    need = pre_s + deadline + margin_s
    rep.check(tgps >= need, where,
              f"terminationGracePeriodSeconds {tgps} < preStop {pre_s} + drain deadline {deadline} + margin {margin_s}")
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    shm = vols.get(mounts.get("/dev/shm", ""), {})
    rep.check(shm.get("emptyDir", {}).get("medium") == "Memory", where, "/dev/shm is not a memory emptyDir")
    rep.check("/models" in mounts, where, "no model cache volume at /models")
    labels = flag(args, "labels") or ""
    rep.check("capacity-type=" in labels and "zone=" in labels, where, "--labels lacks capacity-type/zone")
    rep.check(flag(args, "node-id") == "$(POD_NAME)", where, "--node-id is not the pod name")


def allowed_disruptions(pdb: dict, total: int, healthy: int) -> int:
    """What the disruption controller computes (integers and percentages)."""
    spec = pdb["spec"]

    def count(v: int | str) -> int:
        if isinstance(v, str) and v.endswith("%"):
            return -(-int(v[:-1]) * total // 100)  # rounds up, as Kubernetes does
        return int(v)

    if "minAvailable" in spec:
        desired = count(spec["minAvailable"])
    else:
        desired = total - count(spec["maxUnavailable"])
    return max(0, healthy - desired)


def check_pdbs(rep: Report, overlay: str, docs: list[dict]) -> None:
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        where = f"{overlay} {name_of(d)}"
        labels = pod_labels(d)
        cover = [p for p in pdbs if selects(p["spec"]["selector"], labels)]
        if not rep.check(len(cover) == 1, where, f"covered by {len(cover)} PodDisruptionBudgets, want 1"):
            continue
        total = d["spec"].get("replicas", 1) or 1
        # Steady state: only the leader head is Ready (readiness = leader).
        healthy = 1 if labels.get("app.kubernetes.io/name") == "prism-head" else total
        allowed = allowed_disruptions(cover[0], total, healthy)
        rep.check(allowed >= 1 or total == 0, where,
                  f"PDB {cover[0]['metadata']['name']} allows no eviction at steady state (kubectl drain would hang)")
        if d["metadata"]["name"] == "etcd":
            rep.check(total - allowed >= total // 2 + 1, where, "PDB allows losing etcd quorum")
    names = {pod_labels(d).get("app.kubernetes.io/name") for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    for required in ("etcd", "prism-head", "prism-router", "prism-worker"):
        rep.check(required in names, overlay, f"no workload named {required}")


def check_references(rep: Report, overlay: str, docs: list[dict]) -> None:
    workloads = [d for d in docs if d["kind"] in WORKLOADS]
    for svc in (d for d in docs if d["kind"] == "Service"):
        where = f"{overlay} {name_of(svc)}"
        sel = svc["spec"].get("selector", {})
        targets = [w for w in workloads if selects(sel, pod_labels(w))]
        if not rep.check(bool(targets), where, "selects no pod template"):
            continue
        names = {p.get("name") for w in targets for c in pod_spec(w)["containers"] for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            tp = p.get("targetPort", p["port"])
            if isinstance(tp, str):
                rep.check(tp in names, where, f"targetPort {tp} is no container port name")
    for pm in (d for d in docs if d["kind"] == "PodMonitor"):
        where = f"{overlay} {name_of(pm)}"
        targets = [w for w in workloads if selects(pm["spec"]["selector"], pod_labels(w))]
        rep.check(bool(targets), where, "selects no pod template")
        names = {p.get("name") for w in targets for c in pod_spec(w)["containers"] for p in c.get("ports", [])}
        for ep in pm["spec"]["podMetricsEndpoints"]:
            rep.check(ep.get("port") in names, where, f"port {ep.get('port')} is no container port name")
            rep.check(ep.get("path") == "/metrics", where, "path is not /metrics")
    for so in (d for d in docs if d["kind"] == "ScaledObject"):
        where = f"{overlay} {name_of(so)}"
        ref = so["spec"]["scaleTargetRef"]
        rep.check(any(d["kind"] == ref.get("kind", "Deployment") and d["metadata"]["name"] == ref["name"]
                      for d in docs), where, f"scale target {ref} is not in the overlay")
        queries = " ".join(t["metadata"].get("query", "") for t in so["spec"]["triggers"])
        for metric in ("vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc", "prism_gpu_demand"):
            rep.check(metric in queries, where, f"no trigger on {metric}")
        for t in so["spec"]["triggers"]:
            rep.check(t["type"] == "prometheus" and "serverAddress" in t["metadata"]
                      and float(t["metadata"]["threshold"]) > 0, where, f"bad trigger {t.get('name')}")


def probe_plan(docs: list[dict]) -> list[dict]:
    """HTTP probes of the prism binaries, with the args they run with."""
    plan = []
    seen = set()
    for d in docs:
        spec = pod_spec(d)
        if spec is None or d["kind"] == "Job":
            continue
        for c in spec["containers"]:
            binary = Path((c.get("command") or [""])[0]).name
            if binary not in PRISM_BINARIES:
                continue
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
            probes = []
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                http = c.get(kind, {}).get("httpGet")
                if http:
                    port = http["port"]
                    probes.append({"kind": kind, "path": http["path"],
                                   "port": ports.get(port) if isinstance(port, str) else port})
            key = json.dumps([binary, c.get("args", []), probes], sort_keys=True)
            if key not in seen:
                seen.add(key)
                env = {e["name"]: e.get("value") if "value" in e else {"fieldRef": e["valueFrom"]["fieldRef"]["fieldPath"]}
                       for e in c.get("env", []) if "value" in e or "fieldRef" in e.get("valueFrom", {})}
                plan.append({"workload": name_of(d), "binary": binary, "args": c.get("args", []), "env": env,
                             "probes": probes})
    return plan


TLS_ENV = ("PRISM_TLS_CERT", "PRISM_TLS_KEY", "PRISM_TLS_CA")


def check_mtls(rep: Report, overlay: str, docs: list[dict]) -> None:
    """Every prism workload runs with mutual TLS: the three PRISM_TLS_* files lie under a
    mounted Secret that a cert-manager Certificate writes (from an Issuer that exists), and
    clients check servers against a name every server certificate carries."""
    certs = {d["spec"]["secretName"]: d for d in docs if d["kind"] == "Certificate"}
    issuers = {d["metadata"]["name"] for d in docs if d["kind"] == "Issuer"}
    for c in certs.values():
        ref = c["spec"]["issuerRef"]["name"]
        rep.check(ref in issuers, f"{overlay} {name_of(c)}", f"issuer {ref} does not exist")
    servers = [c for c in certs.values() if "server auth" in c["spec"].get("usages", [])]
    for d in docs:
        spec = pod_spec(d)
        if spec is None:
            continue
        where = f"{overlay} {name_of(d)}"
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            binary = Path((c.get("command") or [""])[0]).name
            if binary not in ("prism-head", "prism-worker", "prism-router", "prism"):
                continue
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            for key in TLS_ENV:
                if not rep.check(bool(env.get(key)), where, f"{key} not set (mTLS off)"):
                    continue
                mount = next((m for m in c.get("volumeMounts", []) if env[key].startswith(m["mountPath"] + "/")), None)
                if not rep.check(mount is not None, where, f"{key}={env[key]} is not under a mounted volume"):
                    continue
                secret = volumes.get(mount["name"], {}).get("secret", {}).get("secretName")
                rep.check(secret in certs, where, f"{key}: Secret {secret} is written by no Certificate")
            name = env.get("PRISM_TLS_SERVER_NAME")
            rep.check(bool(name) and all(name in s["spec"].get("dnsNames", []) for s in servers),
                      where, f"PRISM_TLS_SERVER_NAME {name!r} is not in every server certificate")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2])
    ap.add_argument("--probe-plan", type=Path)
    opts = ap.parse_args()
    rep = Report()
    overlays = sorted(p for p in (opts.repo / "k8s/overlays").iterdir() if (p / "kustomization.yaml").exists())
    rep.check({o.name for o in overlays} >= {"cpu", "gpu"}, "k8s/overlays", "cpu and gpu overlays missing")
    plan: list[dict] = []
    for overlay in overlays:
        docs = render(opts.repo, overlay)
        print(f"{overlay.name}: {len(docs)} resources")
        for d in docs:
            where = f"{overlay.name} {name_of(d)}"
            if d["apiVersion"] in CORE_GROUPS:
                validate_schema(rep, where, d)
            else:
                rep.check(d["apiVersion"] in ("monitoring.coreos.com/v1", "keda.sh/v1alpha1", "cert-manager.io/v1"),
                          where, f"unexpected API {d['apiVersion']}")
            spec = pod_spec(d)
            if spec is None:
                continue
            rep.check(spec.get("automountServiceAccountToken") is False, where, "mounts an API token")
            rep.check(spec.get("serviceAccountName") not in (None, "default"), where, "uses the default ServiceAccount")
            for c in spec.get("initContainers", []):
                check_container(rep, where, c, spec, long_running=False)
            for c in spec["containers"]:
                check_container(rep, where, c, spec, long_running=d["kind"] != "Job")
            if pod_labels(d).get("app.kubernetes.io/name") == "prism-worker":
                check_worker(rep, overlay.name, d)
                if overlay.name == "gpu":
                    res = spec["containers"][0]["resources"]
                    rep.check("nvidia.com/gpu" in res.get("limits", {}), where, "GPU pool without nvidia.com/gpu")
        check_pdbs(rep, overlay.name, docs)
        check_mtls(rep, overlay.name, docs)
        check_references(rep, overlay.name, docs)
        plan += [dict(p, overlay=overlay.name) for p in probe_plan(docs)]
    if opts.probe_plan:
        opts.probe_plan.write_text(json.dumps(plan, indent=2))
    for p in rep.problems:
        print(f"FAIL {p}")
    print(f"manifest checks: {rep.checks - len(rep.problems)} ok, {len(rep.problems)} problems")
    return 1 if rep.problems else 0


if __name__ == "__main__":
    sys.exit(main())
