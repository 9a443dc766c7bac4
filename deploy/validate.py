"""Offline validation of the rendered Kubernetes manifests (called by deploy/check).

For every rendered overlay and every extra manifest file:

1. schemas: each object against the Kubernetes OpenAPI schemas bundled with kubernetes-validate,
   in strict mode (unknown fields fail), for every Kubernetes version asked for; the
   ServiceMonitors (a CRD, which kubernetes-validate has no schema for and would only warn about)
   against deploy/schemas/servicemonitor.monitoring.coreos.com.v1.json. An object of a kind with
   no schema at all is an error, not a warning.
2. consistency: what the schemas cannot see: the daemon's TOML (the ConfigMap fragments joined as
   the init container joins them) against the DaemonSet (mounts, memory, grace period, ports),
   router.urls against the kvrouter StatefulSet, G4 credentials from the Secret only, selectors
   and named ports of Services, ServiceMonitors and NetworkPolicies, and every field of
   docs/configuration.md and docs/router.md section 8 present in the configuration files.
3. binaries (when built): the joined TOML through `kvcached config` and kvrouter's TOML through a
   kvrouter start, i.e. the daemons' own parsers.

Every failure names the overlay (or file), the object and, for schema errors, the Kubernetes
version and the field path. Exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import jsonschema
import yaml
import kubernetes_validate.utils as kv

GIB = 1 << 30
# The DaemonSet's memory beyond the G2 pool (its comment lists what it covers).
MIN_MEMORY_OVERHEAD = 1 * GIB
# Seconds of terminationGracePeriodSeconds beyond engines.drain_ms: the flush of the store
# (G2 only: unlink the pool; with G3: up to g3.writethrough_queue blocks written and synced).
FLUSH_MARGIN_S = {False: 5, True: 60}

failures: list[str] = []


def fail(where: str, msg: str) -> None:
    failures.append(f"{where}: {msg}")
    print(f"  FAIL {where}: {msg}")


def name_of(obj: dict) -> str:
    return f"{obj.get('kind', '?')}/{obj.get('metadata', {}).get('name', '?')}"


# kubernetes-validate reads and parses its schema files on every call; they do not change.
kv.schema_contents = functools.lru_cache(maxsize=None)(kv.schema_contents)


def load_docs(path: Path) -> list[dict]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d]


# ---------------------------------------------------------------------------------------------
# 1. schemas


def validate_schemas(label: str, docs: list[dict], versions: list[str], crd_schemas: dict) -> int:
    n = 0
    for obj in docs:
        where = f"{label} {name_of(obj)}"
        key = (obj.get("apiVersion"), obj.get("kind"))
        if key in crd_schemas:
            validator = jsonschema.Draft202012Validator(crd_schemas[key])
            errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
            for e in errors:
                path = ".".join(str(p) for p in e.absolute_path) or "(object)"
                fail(where, f"{key[0]} schema (deploy/schemas): {path}: {e.message}")
            n += 1
            continue
        # The same error in several versions is reported once, with the versions it holds for.
        errors: dict[tuple[str, str], list[str]] = {}
        for version in versions:
            try:
                kv.validate(obj, version, strict=True)
            except kv.ValidationError as e:
                path = ".".join(str(p) for p in e.path) or "(object)"
                errors.setdefault((path, e.message), []).append(version)
            except kv.SchemaNotFoundError as e:
                fail(where, f"no schema: {e.message}; add one under deploy/schemas or drop the object")
                break
        for (path, message), vs in errors.items():
            span = f"{versions[0]}..{versions[-1]}" if vs == versions else ", ".join(vs)
            fail(where, f"Kubernetes {span} (strict): {path}: {message}")
        n += 1
    return n


# ---------------------------------------------------------------------------------------------
# 2. consistency


def quantity_bytes(q) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    s = str(q)
    for u, m in units.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * m)
    return int(s)


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]


def one(label: str, docs: list[dict], kind: str, name: str) -> dict | None:
    found = find(docs, kind, name)
    if len(found) != 1:
        fail(label, f"expected one {kind}/{name}, found {len(found)}")
        return None
    return found[0]


def container(pod_spec: dict, name: str, init: bool = False) -> dict:
    key = "initContainers" if init else "containers"
    return next(c for c in pod_spec.get(key, []) if c["name"] == name)


def env_value(c: dict, name: str):
    for e in c.get("env", []):
        if e["name"] == name:
            return e
    return None


def joined_config(label: str, docs: list[dict], ds: dict) -> tuple[str, dict] | None:
    """The daemon's TOML as the init container "config" writes it: fragments in name order."""
    vols = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    cm_name = vols["config-fragments"]["configMap"]["name"]
    cm = one(label, docs, "ConfigMap", cm_name)
    if cm is None:
        return None
    text = "".join(cm["data"][k] for k in sorted(cm["data"]))
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        fail(f"{label} ConfigMap/{cm_name}", f"the joined fragments are not valid TOML: {e}")
        return None


def check_env_refs(where: str, c: dict) -> None:
    """$(VAR) in an env value expands only variables defined earlier in the same list."""
    seen: set[str] = set()
    for e in c.get("env", []):
        for ref in re.findall(r"\$\((\w+)\)", str(e.get("value", ""))):
            if ref not in seen:
                fail(where, f"env {e['name']} refers to $({ref}), which is not defined before it")
        seen.add(e["name"])


def check_kvcached(label: str, docs: list[dict], repo: Path) -> tuple[str, dict] | None:
    ds = one(label, docs, "DaemonSet", "kvcached")
    if ds is None:
        return None
    where = f"{label} DaemonSet/kvcached"
    spec = ds["spec"]
    pod = spec["template"]["spec"]
    main = container(pod, "kvcached")
    for c in pod.get("initContainers", []) + pod["containers"]:
        check_env_refs(f"{where} container {c['name']}", c)

    strategy = spec.get("updateStrategy", {})
    ru = strategy.get("rollingUpdate", {})
    if strategy.get("type") != "RollingUpdate" or ru.get("maxUnavailable") != 1 or ru.get("maxSurge", 0) != 0:
        fail(where, "updateStrategy must be RollingUpdate with maxUnavailable 1 and maxSurge 0 (one daemon per node)")
    if pod.get("hostIPC") is not True:
        fail(where, "hostIPC must be true (engines share memory with the daemon)")

    cfg = joined_config(label, docs, ds)
    if cfg is None:
        return None
    text, conf = cfg

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in main.get("volumeMounts", [])}

    def host_mounted(path: str, what: str) -> None:
        m = mounts.get(path)
        if m is None:
            fail(where, f"{what}: {path} is not mounted in container kvcached")
            return
        hp = volumes[m["name"]].get("hostPath")
        if hp is None or hp["path"] != path:
            fail(where, f"{what}: {path} must be the node's {path} (hostPath), found volume {m['name']}")

    g2 = conf.get("g2", {})
    if g2.get("shm_dir") != "/dev/shm":
        fail(where, f"g2.shm_dir is {g2.get('shm_dir')!r}, the manifests share the host's /dev/shm")
    host_mounted("/dev/shm", "g2.shm_dir")
    socket_dir = str(Path(conf.get("socket", "")).parent)
    host_mounted(socket_dir, "socket directory")

    owned = (env_value(container(pod, "host-dirs", init=True), "OWNED_DIRS") or {}).get("value", "").split()
    if socket_dir not in owned:
        fail(where, f"init container host-dirs does not give {socket_dir} to the daemon's user")

    g3 = conf.get("g3", {})
    g3_on = g3.get("enabled", True)
    if g3_on:
        host_mounted(g3.get("dir", ""), "g3.dir")
        if g3.get("dir") not in owned:
            fail(where, f"init container host-dirs does not give g3.dir {g3.get('dir')} to the daemon's user")
        if not g3.get("capacity_bytes"):
            fail(where, "g3.capacity_bytes is 0 (a quarter of the free space): size G3 explicitly")
    elif "g3" in volumes:
        fail(where, "volume g3 is mounted but g3.enabled is false")

    res = main.get("resources", {})
    req, lim = res.get("requests", {}).get("memory"), res.get("limits", {}).get("memory")
    g2_bytes = g2.get("capacity_bytes", 0)
    if not g2_bytes:
        fail(where, "g2.capacity_bytes is 0 (a quarter of the node's memory): memory limits need an explicit pool size")
    elif req is None or lim is None or quantity_bytes(req) != quantity_bytes(lim):
        fail(where, f"memory request ({req}) and limit ({lim}) must be set and equal")
    else:
        overhead = quantity_bytes(lim) - g2_bytes
        if overhead < MIN_MEMORY_OVERHEAD:
            fail(where, f"memory limit {lim} leaves {overhead / GIB:.2f} GiB beyond the G2 pool ({g2_bytes / GIB:.0f} GiB); at least {MIN_MEMORY_OVERHEAD / GIB:.0f} GiB")
        else:
            print(f"  ok   memory {lim} = G2 {g2_bytes / GIB:g} GiB + {overhead / GIB:g} GiB overhead")

    drain_s = conf.get("engines", {}).get("drain_ms", 20000) / 1000
    grace = pod.get("terminationGracePeriodSeconds", 30)
    need = drain_s + FLUSH_MARGIN_S[bool(g3_on)]
    if grace < need:
        fail(where, f"terminationGracePeriodSeconds {grace} < engines.drain_ms ({drain_s:g} s) + flush ({FLUSH_MARGIN_S[bool(g3_on)]} s)")
    else:
        print(f"  ok   terminationGracePeriodSeconds {grace} >= drain {drain_s:g} s + flush {FLUSH_MARGIN_S[bool(g3_on)]} s")

    ports = {p["name"]: p["containerPort"] for p in main.get("ports", [])}
    addr = (env_value(main, "KVCACHED_METRICS_ADDR") or {}).get("value", "")
    if "metrics" not in ports or not addr.endswith(f":{ports['metrics']}"):
        fail(where, f"KVCACHED_METRICS_ADDR {addr!r} does not listen on containerPort metrics {ports.get('metrics')}")
    if addr.startswith(("0.0.0.0", "[::]")) and not conf.get("router", {}).get("advertise_url"):
        fail(where, "metrics_addr is a wildcard address and router.advertise_url is empty: routers get no replay URL")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = main.get(probe, {}).get("httpGet")
        if p is None or p.get("port") not in ("metrics", ports.get("metrics")):
            fail(where, f"{probe} must be an HTTP probe on the metrics port")
    if (env_value(main, "KVCACHED_NODE") or {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "spec.nodeName":
        fail(where, "KVCACHED_NODE must come from spec.nodeName (the default host name is the pod's name)")

    doc_env = set(re.findall(r"KVCACHED_[A-Z0-9_]+", (repo / "docs/configuration.md").read_text()))
    for e in main.get("env", []):
        if e["name"].startswith("KVCACHED_") and e["name"] not in doc_env:
            fail(where, f"env {e['name']} is not a variable docs/configuration.md documents")

    if "g4" in conf:
        g4 = conf["g4"]
        for k in g4:
            if re.search(r"secret|password|token|access_key|key_id|credential", k):
                fail(where, f"[g4] {k}: credentials belong in the Secret, never in the ConfigMap")
        if not str(g4.get("url", "")).startswith("s3://"):
            fail(where, f"g4.url {g4.get('url')!r} is not s3://BUCKET/PREFIX")
        if g4.get("allow_http") is not False:
            fail(where, "g4.allow_http must be false (credentials over TLS only)")
        for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            ref = ((env_value(main, var) or {}).get("valueFrom") or {}).get("secretKeyRef")
            if not ref or ref.get("name") != "kvcached-g4-credentials" or ref.get("optional") is not False:
                fail(where, f"{var} must come from Secret kvcached-g4-credentials with optional: false")
    return text, conf


def check_router_urls(label: str, docs: list[dict], conf: dict) -> None:
    sts = one(label, docs, "StatefulSet", "kvrouter")
    if sts is None:
        return
    where = f"{label} StatefulSet/kvrouter"
    ns = sts["metadata"].get("namespace", "default")
    svc = sts["spec"]["serviceName"]
    peers = one(label, docs, "Service", svc)
    if peers is not None and peers["spec"].get("clusterIP") != "None":
        fail(f"{label} Service/{svc}", "the StatefulSet's serviceName must be a headless Service (per-replica DNS names)")
    c = container(sts["spec"]["template"]["spec"], "kvrouter")
    check_env_refs(f"{where} container kvrouter", c)
    port = {p["name"]: p["containerPort"] for p in c.get("ports", [])}.get("http")
    listen = (env_value(c, "KVROUTER_LISTEN") or {}).get("value", "")
    if not listen.endswith(f":{port}"):
        fail(where, f"KVROUTER_LISTEN {listen!r} is not containerPort http {port}")
    events = conf.get("events", {})
    if events.get("transport", "http") in ("nats", "both"):
        check_nats(label, docs, conf, sts, c)
        if events.get("transport") == "nats":
            print("  ok   router.urls not used (events.transport = \"nats\")")
            return
    replicas = sts["spec"].get("replicas", 1)
    want = {f"http://{sts['metadata']['name']}-{i}.{svc}.{ns}.svc:{port}" for i in range(replicas)}
    have = set(conf.get("router", {}).get("urls", []))
    if have != want:
        fail(where, f"kvcached router.urls must name every replica ({replicas}): missing {sorted(want - have)}, extra {sorted(have - want)}")
    else:
        print(f"  ok   router.urls name all {replicas} kvrouter replicas")


def secret_mounted(where: str, pod: dict, c: dict, path: str, what: str) -> None:
    """`path` lies in a volume of container `c` that comes from a Secret."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for m in c.get("volumeMounts", []):
        if path.startswith(m["mountPath"].rstrip("/") + "/"):
            if "secret" not in volumes.get(m["name"], {}):
                fail(where, f"{what} {path} is in volume {m['name']}, which is not a Secret")
            return
    fail(where, f"{what} {path} is not in any volume mounted in container {c['name']}")


def check_nats(label: str, docs: list[dict], conf: dict, sts: dict, router: dict) -> None:
    """The daemons and the routers name the same NATS servers and deployment, their passwords
    come from Secrets, and a NATS server rendered here serves the client port they name."""
    nats = conf.get("events", {}).get("nats", {})
    servers = nats.get("servers", [])
    where = f"{label} StatefulSet/kvrouter"
    env = {k: (env_value(router, k) or {}).get("value") for k in ("KVROUTER_NATS_SERVERS", "KVROUTER_NATS_CLUSTER", "KVROUTER_NATS_PASSWORD_FILE")}
    if env["KVROUTER_NATS_SERVERS"] is None or env["KVROUTER_NATS_SERVERS"].split(",") != servers:
        fail(where, f"KVROUTER_NATS_SERVERS {env['KVROUTER_NATS_SERVERS']!r} is not the daemons' events.nats.servers {servers}")
    if (env["KVROUTER_NATS_CLUSTER"] or "default") != nats.get("cluster", "default"):
        fail(where, f"KVROUTER_NATS_CLUSTER {env['KVROUTER_NATS_CLUSTER']!r} is not the daemons' events.nats.cluster")
    if env["KVROUTER_NATS_PASSWORD_FILE"]:
        secret_mounted(where, sts["spec"]["template"]["spec"], router, env["KVROUTER_NATS_PASSWORD_FILE"], "KVROUTER_NATS_PASSWORD_FILE")
    ds = one(label, docs, "DaemonSet", "kvcached")
    pw = nats.get("auth", {}).get("password_file")
    if ds is not None and pw:
        pod = ds["spec"]["template"]["spec"]
        secret_mounted(f"{label} DaemonSet/kvcached", pod, container(pod, "kvcached"), pw, "events.nats.auth.password_file")
    for url in servers:
        m = re.fullmatch(r"(?:nats|tls)://([a-z0-9-]+)\.([a-z0-9-]+)\.svc(?:\.cluster\.local)?:(\d+)", url)
        if not m:
            print(f"  ok   NATS server {url} is outside these manifests")
            continue
        name, ns, port = m.group(1), m.group(2), int(m.group(3))
        svc = [d for d in find(docs, "Service", name) if d["metadata"].get("namespace") == ns]
        if not svc:
            fail(label, f"events.nats.servers names {url}, but no Service {name} in namespace {ns} is rendered")
        elif port not in [p["port"] for p in svc[0]["spec"].get("ports", [])]:
            fail(f"{label} Service/{name}", f"has no port {port} (events.nats.servers {url})")
    js = find(docs, "StatefulSet", "nats")
    if js and js[0]["spec"].get("replicas", 1) < nats.get("replicas", 1):
        fail(f"{label} StatefulSet/nats", f"{js[0]['spec'].get('replicas', 1)} servers cannot hold events.nats.replicas = {nats.get('replicas')} copies")
    print(f"  ok   daemons and routers read NATS {servers} (deployment {nats.get('cluster', 'default')!r})")


def pods_of(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, pod template) for every workload."""
    return [(d, d["spec"]["template"]) for d in docs if d.get("kind") in ("DaemonSet", "StatefulSet", "Deployment")]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in (selector or {}).items())


def check_selectors(label: str, docs: list[dict]) -> None:
    templates = pods_of(docs)
    services = find(docs, "Service")
    for svc in services:
        where = f"{label} {name_of(svc)}"
        matched = [t for _, t in templates if selects(svc["spec"].get("selector"), t["metadata"].get("labels", {}))]
        if not matched:
            fail(where, "selects no pods")
        names = {p["name"] for t in matched for c in t["spec"]["containers"] for p in c.get("ports", [])}
        for p in svc["spec"].get("ports", []):
            if isinstance(p.get("targetPort"), str) and p["targetPort"] not in names:
                fail(where, f"targetPort {p['targetPort']} is no container port of the selected pods")
    for pdb in find(docs, "PodDisruptionBudget"):
        where = f"{label} {name_of(pdb)}"
        owners = [w for w, t in templates if selects(pdb["spec"]["selector"].get("matchLabels"), t["metadata"].get("labels", {}))]
        if len(owners) != 1:
            fail(where, f"selects the pods of {len(owners)} workloads, expected 1")
        elif owners[0]["kind"] == "DaemonSet" and ("maxUnavailable" in pdb["spec"] or not isinstance(pdb["spec"].get("minAvailable"), int)):
            fail(where, "for DaemonSet pods only an integer minAvailable works (no scale subresource)")
    for np in find(docs, "NetworkPolicy"):
        where = f"{label} {name_of(np)}"
        sel = np["spec"]["podSelector"].get("matchLabels", {})
        matched = [t for _, t in templates if selects(sel, t["metadata"].get("labels", {}))]
        if sel and not matched:
            fail(where, "podSelector matches no pods")
        names = {p["name"] for t in matched for c in t["spec"]["containers"] for p in c.get("ports", [])}
        for rule in np["spec"].get("ingress", []):
            for p in rule.get("ports", []):
                if isinstance(p.get("port"), str) and p["port"] not in names:
                    fail(where, f"port {p['port']} is no container port of the selected pods")
    for sm in find(docs, "ServiceMonitor"):
        where = f"{label} {name_of(sm)}"
        sel = sm["spec"]["selector"].get("matchLabels", {})
        matched = [s for s in services if selects(sel, s["metadata"].get("labels", {}))]
        if len(matched) != 1:
            fail(where, f"selects {len(matched)} Services, expected 1 (two would scrape every target twice)")
            continue
        svc_ports = {p.get("name") for p in matched[0]["spec"]["ports"]}
        for ep in sm["spec"]["endpoints"]:
            if ep.get("port") not in svc_ports:
                fail(where, f"endpoint port {ep.get('port')} is not a port of Service {matched[0]['metadata']['name']}")


def check_images(label: str, docs: list[dict], dockerfile: str) -> None:
    shipped = set()
    for m in re.finditer(r"^COPY --from=builder (.+) /usr/local/bin/\s*$", dockerfile, re.M):
        shipped |= {Path(p).name for p in m.group(1).split()}
    for w, t in pods_of(docs):
        for c in t["spec"].get("initContainers", []) + t["spec"]["containers"]:
            cmd = (c.get("command") or [""])[0]
            if cmd.startswith("/usr/local/bin/") and Path(cmd).name not in shipped:
                fail(f"{label} {name_of(w)}", f"container {c['name']} runs {cmd}, which deploy/Dockerfile does not install")


def toml_keys(text: str) -> set[str]:
    """Dotted keys of a TOML text: those it sets (inline tables and arrays of tables included)
    and those only shown commented (`# key = ...`, under the [table] or `# [table]` above)."""

    def flatten(node, prefix: str) -> set[str]:
        if isinstance(node, list) and node and all(isinstance(x, dict) for x in node):
            return set().union(*(flatten(x, prefix) for x in node))
        if isinstance(node, dict):
            return set().union(set(), *(flatten(v, f"{prefix}{k}.") for k, v in node.items()))
        return {prefix[:-1]}

    keys = flatten(tomllib.loads(text), "")
    table = ""
    for line in text.splitlines():
        if h := re.match(r"^#?\s*\[+([a-z_0-9.]+)\]+\s*(#.*)?$", line):
            table = h.group(1) + "."
        elif c := re.match(r"^#\s*([a-z_0-9]+)\s*=", line):
            keys.add(table + c.group(1))
    return keys


def documented_fields(repo: Path) -> tuple[set[str], set[str]]:
    """Fields of docs/configuration.md's table and of docs/router.md section 8's example."""
    daemon = set()
    for line in (repo / "docs/configuration.md").read_text().splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            daemon |= set(re.findall(r"`([a-z0-9_.]+)`", first_cell))
    text = (repo / "docs/router.md").read_text()
    m = re.search(r"^## 8\. Configuration.*?```toml\n(.*?)```", text, re.S | re.M)
    router = toml_keys(m.group(1)) if m else set()
    return daemon, router


def has_field(conf: dict, text: str, dotted: str) -> bool:
    node = conf
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return dotted in toml_keys(text)
        node = node[part]
    return True


def check_documented_fields(repo: Path, daemon_texts: list[tuple[str, dict]], router_text: str) -> None:
    before = len(failures)
    daemon, router = documented_fields(repo)
    if not daemon or not router:
        fail("docs", "could not read the field lists of docs/configuration.md or docs/router.md section 8")
        return
    for field in sorted(daemon):
        if not any(has_field(conf, text, field) for text, conf in daemon_texts):
            fail("kvcached TOML", f"{field} (docs/configuration.md) is in no overlay's configuration, set or commented")
    mine = toml_keys(router_text)
    for field in sorted(router - mine):
        fail("kvrouter.toml", f"{field} (docs/router.md section 8) is neither set nor commented")
    if len(failures) == before:
        print(f"  ok   every documented field is set or commented: {len(daemon)} of kvcached, {len(router)} of kvrouter")


# ---------------------------------------------------------------------------------------------
# 3. binaries


def run_binaries(kvcached: str | None, kvrouter: str | None, overlays: dict, router_text: str) -> None:
    if kvcached:
        print(f"binaries: each overlay's joined kvcached.toml through `{kvcached} config`")
        def kvcached_config(text: str, env: dict) -> tuple[int, str]:
            with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
                f.write(text)
                f.flush()
                clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "XDG_"))}
                clean.update(env, NO_COLOR="1")
                r = subprocess.run([kvcached, "--config", f.name, "config"], env=clean, capture_output=True, text=True, timeout=60)
            return r.returncode, (r.stdout + r.stderr).strip()

        for label, (text, env) in overlays.items():
            rc, out = kvcached_config(text, env)
            if rc == 0:
                print(f"  ok   {label}: kvcached accepts it")
            else:
                fail(f"{label} kvcached config", out[-600:])
    else:
        print("binaries: SKIP kvcached config check (no kvcached binary built; set KVCACHED_BIN or build it)")
    if kvrouter:
        print(f"binaries: kvrouter.toml through a start of `{kvrouter}` on 127.0.0.1:0")
        with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
            f.write(router_text)
            f.flush()
            env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
            env["NO_COLOR"] = "1"
            p = subprocess.Popen([kvrouter, "--listen", "127.0.0.1:0", "--config", f.name], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            deadline = time.monotonic() + 2.0
            while p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                print("  ok   kvrouter started with it (and stopped on SIGTERM)")
            else:
                fail("kvrouter.toml", f"kvrouter exited with {p.returncode}: {p.stdout.read()[-600:] if p.stdout else ''}")
    else:
        print("binaries: SKIP kvrouter start check (no kvrouter binary built; set KVROUTER_BIN or build it)")


def check_runtime_libraries(binaries: list[str], dockerfile: str) -> None:
    """Every shared library the built binaries load comes from a package the runtime stage
    installs (ldd, then dpkg -S on this Debian host, the builder's release)."""
    runtime = dockerfile[dockerfile.rfind("\nFROM "):]
    m = re.search(r"apt-get install -y --no-install-recommends ([^\\&\n]+)", runtime)
    installed = set(m.group(1).split()) if m else set()
    if not shutil.which("ldd") or not shutil.which("dpkg"):
        print("libraries: SKIP (no ldd or dpkg here)")
        return
    print(f"libraries: ldd of {', '.join(binaries)} against the runtime stage's packages ({' '.join(sorted(installed))})")
    for b in binaries:
        out = subprocess.run(["ldd", b], capture_output=True, text=True).stdout
        for line in out.splitlines():
            lib = re.search(r"(/\S+)\s+\(0x", line)
            if "not found" in line:
                fail(f"ldd {b}", line.strip())
            if not lib or "linux-vdso" in line:
                continue
            path = os.path.realpath(lib.group(1))
            owner = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True).stdout
            if not owner:  # e.g. /lib64/ld-linux-x86-64.so.2 through a symlink dpkg knows by another name
                owner = subprocess.run(["dpkg", "-S", lib.group(1)], capture_output=True, text=True).stdout
            pkg = owner.split(":")[0].strip() if owner else "?"
            if pkg not in installed:
                fail(f"ldd {Path(b).name}", f"{lib.group(1)} comes from package {pkg}, which deploy/Dockerfile's runtime stage does not install")
            else:
                print(f"  ok   {Path(b).name}: {Path(lib.group(1)).name} ({pkg})")


def literal_env(ds_docs: list[dict]) -> dict[str, str]:
    """The DaemonSet's KVCACHED_* variables with node-only values filled in for a check here."""
    ds = find(ds_docs, "DaemonSet", "kvcached")[0]
    main = container(ds["spec"]["template"]["spec"], "kvcached")
    env = {}
    for e in main.get("env", []):
        if not e["name"].startswith("KVCACHED_"):
            continue
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\(POD_IP\)", "127.0.0.1", e["value"])
        elif e["name"] == "KVCACHED_NODE":
            env[e["name"]] = "node-check"
    return env


# ---------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, required=True)
    ap.add_argument("--versions", required=True, help="comma-separated Kubernetes versions, or 'all' from --min-version")
    ap.add_argument("--overlay", action="append", default=[], metavar="NAME=RENDERED.yaml")
    ap.add_argument("--file", action="append", default=[], type=Path, help="a manifest outside the overlays")
    ap.add_argument("--kvcached")
    ap.add_argument("--kvrouter")
    args = ap.parse_args()

    bundled = sorted({kv.major_minor(v) for v in kv.all_versions()}, key=lambda v: tuple(map(int, v.split("."))))
    lo, _, hi = args.versions.partition("..")
    if hi:
        versions = [v for v in bundled if tuple(map(int, lo.split("."))) <= tuple(map(int, v.split("."))) <= tuple(map(int, (hi if hi != "newest" else bundled[-1]).split(".")))]
    else:
        versions = args.versions.split(",")
    for v in versions:
        if v not in bundled:
            print(f"FAIL kubernetes-validate has no schemas for Kubernetes {v} (it bundles {bundled[0]}..{bundled[-1]})")
            return 1

    crd_schemas = {}
    for p in sorted((args.repo / "deploy/schemas").glob("*.json")):
        s = json.loads(p.read_text())
        jsonschema.Draft202012Validator.check_schema(s)
        crd_schemas[(s["properties"]["apiVersion"]["const"], s["properties"]["kind"]["const"])] = s
    dockerfile = (args.repo / "deploy/Dockerfile").read_text()

    print(f"schemas: Kubernetes {', '.join(versions)} (kubernetes-validate, strict); "
          f"{', '.join(k for _, k in crd_schemas)} against deploy/schemas")
    daemon_texts: list[tuple[str, dict]] = []
    binary_inputs: dict[str, tuple[str, dict]] = {}
    router_text = (args.repo / "deploy/k8s/base/kvrouter/kvrouter.toml").read_text()
    for spec in args.overlay:
        label, _, path = spec.partition("=")
        docs = load_docs(Path(path))
        before = len(failures)
        n = validate_schemas(label, docs, versions, crd_schemas)
        kinds = sorted({d["kind"] for d in docs})
        print(f"{label}: {n} objects ({', '.join(kinds)}) {'valid' if len(failures) == before else 'INVALID'} against every version")
        got = check_kvcached(label, docs, args.repo)
        if got:
            daemon_texts.append(got)
            binary_inputs[label] = (got[0], literal_env(docs))
            check_router_urls(label, docs, got[1])
        check_selectors(label, docs)
        check_images(label, docs, dockerfile)
        cms = find(docs, "ConfigMap")
        rcm = [c for c in cms if "kvrouter.toml" in c.get("data", {})]
        if len(rcm) != 1 or rcm[0]["data"]["kvrouter.toml"] != router_text:
            fail(label, "the kvrouter ConfigMap does not hold deploy/k8s/base/kvrouter/kvrouter.toml")
        print(f"{label}: consistency checks {'passed' if len(failures) == before else 'FAILED'}")
    for path in args.file:
        docs = load_docs(path)
        label = str(path.resolve().relative_to(args.repo.resolve()))
        before = len(failures)
        n = validate_schemas(label, docs, versions, crd_schemas)
        print(f"{label}: {n} objects {'valid' if len(failures) == before else 'INVALID'} against every version")
        for d in docs:
            for c in d.get("spec", {}).get("containers", []):
                check_env_refs(f"{label} {name_of(d)} container {c['name']}", c)
    check_documented_fields(args.repo, daemon_texts, router_text)
    run_binaries(args.kvcached, args.kvrouter, binary_inputs, router_text)
    built = [b for b in (args.kvcached, args.kvrouter) if b]
    if built:
        check_runtime_libraries(built, dockerfile)

    if failures:
        print(f"\n{len(failures)} failure(s):")
        for f in failures:
            print(f"  {f}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
