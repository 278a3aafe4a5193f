#!/usr/bin/env python3
"""test_k8s.py: `tandem k8s render` and `tandem health` (docs/deploy.md, "Kubernetes").

Cases (--case, one ctest each):
  render   the example clusters (deploy/local.yaml, deploy/multi-host.yaml, deploy/k8s.yaml)
           rendered to stdout and with --out DIR (the same objects), every manifest valid
           against the Kubernetes 1.30 API schemas, strict (an unknown field fails; the
           schemas come with the kubernetes-validate package: nothing is fetched), and the
           render's own rules: the ConfigMap's YAML loads with td_cfg_load and is a fixed
           point of the rewrite (rendered again, it is unchanged), membership points at the
           join Service, one container per decode rank and per prefill stage with the node
           command lines, exec probes running `tandem health`, the grace period, PDBs,
           non-root pods; then a YAML with every rewritten key (cuda, devices, a draft
           model, a prefix cache tier, a chat template file, router TLS and control-plane
           security) on the synthetic model: GPUs per container, devices removed, the
           Secret and ConfigMap mounts, and the memory requests recomputed here from the
           model's header by the formula docs/deploy.md gives
  errors   a missing file, invalid YAML, a schema error, bad options: a clear message on
           stderr, exit status 1, nothing on stdout
  health   `tandem health` against a real decode instance (synthetic model): exit 1 before
           it listens, 0 once ready (and with --alive), 1 after SIGTERM; against an http
           URL with nothing there: 1
  dp_pod   a data-parallel group (dp 2) rendered into one pod (a container per member, each
           joining as POD.K at its port), then that pod's rendered command lines run here
           with the router's: the group forms, both members join and pass their probes, and
           both answer requests with the same greedy text

usage: test_k8s.py --case NAME --tandem BIN [--decode BIN] [--router BIN] --synth-dir DIR
                   --source-dir DIR
"""
import argparse
import glob
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from tdtest.checks import check, summary  # noqa: E402
from tdtest.ports import free_port  # noqa: E402

K8S_VERSION = "1.30.0"  # the API the manifests are checked against (a fixed version)
MIB = 1 << 20
OVERHEAD = 256 * MIB


def render(tandem, path, *extra, ok=True):
    r = subprocess.run([tandem, "k8s", "render", path, *extra], capture_output=True, text=True,
                       timeout=120)
    if ok and r.returncode != 0:
        print(r.stderr)
    return r


def load_all(text):
    return [d for d in yaml.safe_load_all(text) if d is not None]


def validate(docs, what):
    import kubernetes_validate
    for d in docs:
        name = f"{what}: {d['kind']}/{d['metadata']['name']}"
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
            check(True, f"{name} valid against Kubernetes {K8S_VERSION} (strict)")
        except Exception as e:  # ValidationError, SchemaNotFoundError
            check(False, f"{name} valid against Kubernetes {K8S_VERSION}: {e}")


def by_kind(docs):
    out = {}
    for d in docs:
        out.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    return out


def cfg_of(docs):
    cm = [d for d in docs if d["kind"] == "ConfigMap"][0]
    return cm["data"]["cluster.yaml"], yaml.safe_load(cm["data"]["cluster.yaml"])


def mib(b):
    return f"{(b + MIB - 1) // MIB}Mi"


# ---- the model's shape, read here with the gguf package, and the formula ----------------

def model_shape(path):
    import gguf
    r = gguf.GGUFReader(path)

    def val(key):
        f = r.fields.get(key)
        return None if f is None else f.contents()

    arch = val("general.architecture")
    n_head = val(f"{arch}.attention.head_count")
    n_embd = val(f"{arch}.embedding_length")
    head_dim = val(f"{arch}.attention.key_length") or n_embd // n_head
    return {"size": os.path.getsize(path), "n_layer": val(f"{arch}.block_count"),
            "n_head": n_head, "n_head_kv": val(f"{arch}.attention.head_count_kv") or n_head,
            "head_dim": head_dim}


def max_kv_heads(n_head, n_head_kv, tp):
    """common/td_tp.h: the KV heads the query heads of each rank read; the largest."""
    n_q, group = n_head // tp, n_head // n_head_kv
    return max((r * n_q + n_q - 1) // group - (r * n_q) // group + 1 for r in range(tp))


def decode_kv(m, d):
    if "kv_memory" in d:
        return d["kv_memory_bytes"]
    tp = d.get("tp", 1)
    heads = max_kv_heads(m["n_head"], m["n_head_kv"], tp)
    dt = 4 if d.get("kv_dtype") == "f32" else 2
    return (d.get("kv_blocks", 4096) * d.get("block_size", 16) * m["n_layer"] * 2 * heads *
            m["head_dim"] * dt)


def decode_rank_bytes(m, d):
    return m["size"] // d.get("tp", 1) + decode_kv(m, d) + OVERHEAD


def prefill_stage_bytes(m, p, kv_dtype, s):
    pp = p.get("pp", 1)
    lp = p.get("layer_partition")
    layers = lp[s] if lp else m["n_layer"] // pp + (1 if s >= pp - m["n_layer"] % pp else 0)
    dt = 4 if kv_dtype == "f32" else 2
    kv = p.get("kv_tokens", 32768) * layers * 2 * m["n_head_kv"] * m["head_dim"] * dt
    cache = p.get("prefix_cache_mb", 256) * MIB if p.get("prefix_cache", True) else 0
    return m["size"] * layers // m["n_layer"] + kv + cache + OVERHEAD


# ---- the render's rules on one set of manifests -------------------------------------------

def check_router(objs, base, cfg, grace, what):
    dep = objs["Deployment"].get(f"{base}-router")
    if not check(dep is not None, f"{what}: Deployment {base}-router"):
        return
    spec = dep["spec"]
    check(spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate",
          f"{what}: the router: 1 replica, Recreate (the membership lives in it)")
    pod = spec["template"]["spec"]
    ann = spec["template"]["metadata"]["annotations"]
    port = int(cfg["router"]["listen"].rsplit(":", 1)[1])
    check(ann.get("prometheus.io/scrape") == "true" and ann.get("prometheus.io/path") == "/metrics"
          and ann.get("prometheus.io/port") == str(port),
          f"{what}: the router's pods carry the Prometheus annotations (/metrics on {port})")
    c = pod["containers"][0]
    check(c["command"][:1] == ["tandem-router"], f"{what}: the router runs tandem-router")
    check(c["readinessProbe"]["httpGet"]["path"] == "/health" and
          c["livenessProbe"]["httpGet"]["path"] == "/version",
          f"{what}: router readiness GET /health, liveness GET /version")
    check(pod["terminationGracePeriodSeconds"] == grace, f"{what}: router grace {grace} s")
    svc = objs["Service"].get(f"{base}-router")
    check(svc and svc["spec"]["ports"][0]["port"] == port, f"{what}: Service {base}-router:{port}")
    mem = cfg["router"]["membership"]
    mport = int(mem["listen"].rsplit(":", 1)[1])
    join = objs["Service"].get(f"{base}-join")
    check(join and join["spec"]["ports"][0]["port"] == mport and
          join["spec"].get("publishNotReadyAddresses") is True,
          f"{what}: Service {base}-join:{mport} publishes the router before it is ready")
    check(mem["address"] == f"{base}-join:{mport}" and mem["seed"] is False and
          mem["listen"] == f"0.0.0.0:{mport}",
          f"{what}: membership: listen 0.0.0.0:{mport}, address {base}-join:{mport}, seed false")


def check_pod_common(pod, model, what):
    sc = pod["securityContext"]
    check(sc.get("runAsNonRoot") is True and sc.get("runAsUser", 0) != 0,
          f"{what}: non-root pod")
    for c in pod["containers"] + pod.get("initContainers", []):
        csc = c["securityContext"]
        check(csc.get("allowPrivilegeEscalation") is False and csc["capabilities"]["drop"] == ["ALL"]
              and csc.get("readOnlyRootFilesystem") is True,
              f"{what}: container {c['name']}: no privilege escalation, no capabilities")
    init = pod["initContainers"][0]
    check(init["name"] == "fetch-model" and model in init["command"] and
          "/opt/tandem/scripts/fetch_model.py" in init["command"][2],
          f"{what}: init container fetches {model} with fetch_model.py unless it is there")


def probe_cmd(c, key):
    return c.get(key, {}).get("exec", {}).get("command")


def dns(name):
    return name.lower().replace("_", "-").replace(".", "-")


def check_decode(objs, base, d, grace, what, model_shape_=None, gpu=False):
    name = f"{base}-{dns(d['name'])}"
    sts = objs["StatefulSet"].get(name)
    if not check(sts is not None, f"{what}: StatefulSet {name}"):
        return
    tp, port = d.get("tp", 1), d["port"]
    pod = sts["spec"]["template"]["spec"]
    check(sts["spec"]["serviceName"] == name and objs["Service"][name]["spec"]["clusterIP"] == "None",
          f"{what}: {name}: headless Service")
    check(pod.get("shareProcessNamespace") is True, f"{what}: {name}: ranks share pids")
    check(pod["terminationGracePeriodSeconds"] == grace, f"{what}: {name}: grace {grace} s")
    cs = pod["containers"]
    check(len(cs) == tp and [c["name"] for c in cs] == [f"rank-{r}" for r in range(tp)],
          f"{what}: {name}: one container per rank ({tp})")
    shm = [v for v in pod["volumes"] if v["name"] == "shm"]
    check(shm and shm[0]["emptyDir"].get("medium") == "Memory", f"{what}: {name}: /dev/shm in memory")
    for r, c in enumerate(cs):
        cmd = c["command"]
        want = ["tandem-decode", "--config", "/etc/tandem/cluster.yaml", "--instance", d["name"],
                "--rank", str(r), "--name", "$(POD_NAME)", "--advertise", "$(POD_IP)"]
        if r == 0:
            want += ["--listen", f"tcp://0.0.0.0:{port}"]
        check(cmd == want, f"{what}: {name} rank {r}: {' '.join(cmd)}")
        check(any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"]),
              f"{what}: {name} rank {r} mounts /dev/shm")
        res = c["resources"]
        check(res["requests"]["cpu"] == str(d.get("threads", 1)),
              f"{what}: {name} rank {r}: cpu request = threads ({d.get('threads', 1)})")
        check((res.get("limits", {}).get("nvidia.com/gpu") == 1) == gpu,
              f"{what}: {name} rank {r}: {'one GPU' if gpu else 'no GPU'}")
        if model_shape_:
            b = decode_rank_bytes(model_shape_, d)
            check(res["requests"].get("memory") == mib(b) and
                  res["limits"].get("memory") == mib(b + b // 4),
                  f"{what}: {name} rank {r}: memory {mib(b)} (limit {mib(b + b // 4)}), "
                  f"got {res['requests'].get('memory')}")
    url = f"tcp://127.0.0.1:{port}"
    c0 = cs[0]
    check(probe_cmd(c0, "readinessProbe") == ["tandem", "health", "--config",
                                              "/etc/tandem/cluster.yaml", url] and
          probe_cmd(c0, "livenessProbe") == ["tandem", "health", "--alive", "--config",
                                             "/etc/tandem/cluster.yaml", url],
          f"{what}: {name}: rank 0's probes run tandem health {url}")
    check(c0["ports"][0]["containerPort"] == port, f"{what}: {name}: rank 0 exposes {port}")
    check(all("readinessProbe" not in c for c in cs[1:]), f"{what}: {name}: no probe on ranks > 0")
    pdb = objs["PodDisruptionBudget"].get(name)
    check(pdb and pdb["spec"]["maxUnavailable"] == 1, f"{what}: {name}: PodDisruptionBudget")
    return sum(int(c["resources"]["requests"]["cpu"]) for c in cs)


def check_prefill(objs, base, p, grace, what, model_shape_=None, kv_dtype="f16", gpu=False):
    name = f"{base}-{dns(p['name'])}"
    dep = objs["Deployment"].get(name)
    if not check(dep is not None, f"{what}: Deployment {name}"):
        return
    pp, port = p.get("pp", 1), p["port"]
    pod = dep["spec"]["template"]["spec"]
    cs = pod["containers"]
    check([c["name"] for c in cs] == [f"stage-{s}" for s in range(pp)],
          f"{what}: {name}: one container per stage ({pp})")
    check(pod["terminationGracePeriodSeconds"] == grace, f"{what}: {name}: grace {grace} s")
    for s, c in enumerate(cs):
        tail = ["--listen", f"tcp://0.0.0.0:{port}"] if s == 0 else \
            ["--leader", f"tcp://127.0.0.1:{port}"]
        want = ["tandem-prefill", "--config", "/etc/tandem/cluster.yaml", "--instance", p["name"],
                "--stage", str(s), "--name", "$(POD_NAME)", "--advertise", "$(POD_IP)", *tail]
        check(c["command"] == want, f"{what}: {name} stage {s}: {' '.join(c['command'])}")
        res = c["resources"]
        check(res["requests"]["cpu"] == str(p.get("threads", 1)),
              f"{what}: {name} stage {s}: cpu request = threads")
        check((res.get("limits", {}).get("nvidia.com/gpu") == 1) == gpu,
              f"{what}: {name} stage {s}: {'one GPU' if gpu else 'no GPU'}")
        if model_shape_:
            b = prefill_stage_bytes(model_shape_, p, kv_dtype, s)
            check(res["requests"].get("memory") == mib(b),
                  f"{what}: {name} stage {s}: memory {mib(b)}, got {res['requests'].get('memory')}")
    check(probe_cmd(cs[0], "readinessProbe")[-1] == f"tcp://127.0.0.1:{port}",
          f"{what}: {name}: stage 0's readiness probe")
    pdb = objs["PodDisruptionBudget"].get(name)
    check(pdb and pdb["spec"]["maxUnavailable"] == 1, f"{what}: {name}: PodDisruptionBudget")


def check_cluster(a, tmp, path, base, extra=(), shape=None, local=None):
    """Renders path (name base) to stdout and to a directory; validates and checks it.
    local: {pod path prefix: local one} for the files the render must read again (the
    Secret's and the template's, which are not at their pods' paths here)."""
    what = os.path.basename(path)
    r = render(a.tandem, path, "--name", base, *extra)
    if not check(r.returncode == 0, f"{what}: rendered (exit {r.returncode})"):
        return None
    docs = load_all(r.stdout)
    out = os.path.join(tmp, f"out-{base}")
    r2 = render(a.tandem, path, "--name", base, "--out", out, "--quiet", *extra)
    files = sorted(glob.glob(os.path.join(out, "*.yaml")))
    docs2 = [d for f in files for d in load_all(open(f).read())]
    check(r2.returncode == 0 and r2.stderr == "" and docs2 == docs,
          f"{what}: --out DIR writes the same {len(docs)} objects, one file each, "
          f"--quiet says nothing")
    validate(docs, what)
    objs = by_kind(docs)
    text, cfg = cfg_of(docs)
    src = yaml.safe_load(open(path))
    drain = cfg["router"].get("drain_timeout_ms", 30000)
    grace = (drain + 999) // 1000 + 15
    check_router(objs, base, cfg, grace, what)
    # the ConfigMap's YAML: td_cfg_load takes it (render loads it), and the rewrite is a
    # fixed point: rendered again, the text is the same
    again = os.path.join(tmp, f"again-{base}.yaml")
    with open(again, "w") as f:
        t = text
        for pod, here in (local or {}).items():
            t = t.replace(pod, here)
        f.write(t)
    r3 = render(a.tandem, again, "--name", base, "--quiet", *extra)
    check(r3.returncode == 0 and cfg_of(load_all(r3.stdout))[0] == text,
          f"{what}: the ConfigMap's YAML loads (td_cfg_load) and renders to itself")
    check(cfg["model"] == "/models/" + os.path.basename(src["model"]),
          f"{what}: model -> {cfg['model']}")
    tls = src.get("kvxfer", {}).get("ucx_tls", "sm,tcp,self")
    check(cfg.get("kvxfer", {}).get("ucx_tls", "sm,tcp,self") == (tls if "tcp" in tls else "tcp"),
          f"{what}: kvxfer.ucx_tls has tcp")
    model = os.path.basename(src["model"])
    for d in objs["StatefulSet"].values():
        check_pod_common(d["spec"]["template"]["spec"], model, f"{what}: {d['metadata']['name']}")
    for d in objs["Deployment"].values():
        check_pod_common(d["spec"]["template"]["spec"], model, f"{what}: {d['metadata']['name']}")
    gpu = src.get("backend") == "cuda"
    for d in cfg.get("decode", []):
        dd = dict(d)
        dd.setdefault("port", 9000 + cfg["decode"].index(d))
        if "kv_memory" in dd:
            dd["kv_memory_bytes"] = parse_size(dd["kv_memory"])
        dgrace = (dd.get("drain_timeout_ms", 0) + 999) // 1000 + 15
        cpu = check_decode(objs, base, dd, dgrace, what, shape, gpu)
        check(cpu == dd.get("threads", 1) * dd.get("tp", 1),
              f"{what}: {base}-{dns(d['name'])}: the pod's cpu = threads x tp ({cpu})")
    kv_dtype = cfg["decode"][0].get("kv_dtype", "f16")
    for i, p in enumerate(cfg.get("prefill", []) or []):
        pp = dict(p)
        pp.setdefault("port", 9100 + i)
        grace = (pp.get("drain_timeout_ms", 0) + 999) // 1000 + 15  # its drain + 15 s
        check_prefill(objs, base, pp, grace, what, shape, kv_dtype, gpu)
    return docs, r.stderr


def parse_size(s):
    s = str(s)
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "KB": 10**3,
             "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    for u, k in units.items():
        if s.endswith(u):
            return int(s[:-len(u)]) * k
    return int(s)


def everything_yaml(tmp, model):
    """A cluster with every key the render rewrites, on the synthetic model."""
    for f in ("ca.pem", "node.pem", "node.key", "http.pem", "http.key"):
        with open(os.path.join(tmp, f), "w") as fh:
            fh.write("not read by the render\n")
    tpl = os.path.join(tmp, "chat_template.jinja")
    with open(tpl, "w") as f:
        f.write("{% for m in messages %}{{ m['content'] }}\n{% endfor %}\n")
    text = f"""model: {model}
backend: cuda
router:
  listen: 127.0.0.1:8123
  drain_timeout_ms: 5000
  chat_template: {tpl}
  tls_cert: {tmp}/http.pem
  tls_key: {tmp}/http.key
  membership: {{listen: 127.0.0.1:9400, lease_ms: 4000}}
prefill:
  - name: pre_fill.A
    pp: 2
    threads: 3
    layer_partition: [1, 1]
    devices: [0, 1]
    kv_tokens: 4096
    prefix_cache_mb: 64
decode:
  - name: D0
    tp: 2
    threads: 2
    kv_blocks: 512
    block_size: 32
    kv_dtype: f32
    devices: [0, 0]
    speculative: {{method: draft, draft: {model}}}
  - name: d1
    kv_memory: 64MiB
    block_size: 32
    kv_dtype: f32
kvxfer:
  ucx_tls: posix,cma,self
security:
  ca: {tmp}/ca.pem
  cert: {tmp}/node.pem
  key: {tmp}/node.key
"""
    path = os.path.join(tmp, "every.yaml")
    with open(path, "w") as f:
        f.write(text)
    return path


def case_render(a, tmp):
    for f in ("local.yaml", "multi-host.yaml", "k8s.yaml"):
        path = os.path.join(a.source_dir, "deploy", f)
        base = "tandem" if f == "k8s.yaml" else os.path.splitext(f)[0]
        res = check_cluster(a, tmp, path, base)
        if res and f == "local.yaml":
            check("kvxfer.ucx_tls: posix,cma,self -> tcp" in res[1],
                  "local.yaml: the rewrite of ucx_tls is said on stderr")
    # --namespace writes the Namespace first and puts every object in it
    r = render(a.tandem, os.path.join(a.source_dir, "deploy/k8s.yaml"), "--name", "tandem",
               "--namespace", "serving", "--image", "registry.example/tandem:1.0", "--quiet")
    docs = load_all(r.stdout)
    check(r.returncode == 0 and docs[0]["kind"] == "Namespace" and
          all(d["metadata"].get("namespace") == "serving" for d in docs[1:]),
          "--namespace: the Namespace first, every object in it")
    imgs = {c["image"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")
            for c in d["spec"]["template"]["spec"]["containers"]}
    check(imgs == {"registry.example/tandem:1.0"}, f"--image: every container's image ({imgs})")

    model = os.path.join(a.synth_dir, "llama.gguf")
    shape = model_shape(model)
    path = everything_yaml(tmp, model)
    res = check_cluster(a, tmp, path, "every", shape=shape,
                        local={"/etc/tandem/secret/": tmp + "/",
                               "/etc/tandem/chat_template.jinja": tmp + "/chat_template.jinja"})
    if not res:
        return
    docs, err = res
    objs = by_kind(docs)
    text, cfg = cfg_of(docs)
    check("devices" not in cfg["decode"][0] and "devices" not in cfg["prefill"][0],
          "devices removed (one GPU per container)")
    check(cfg["decode"][0]["speculative"]["draft"] == "/models/llama.gguf",
          "the draft model moves to the model volume")
    check(cfg["router"]["chat_template"] == "/etc/tandem/chat_template.jinja" and
          "chat_template.jinja" in objs["ConfigMap"]["every-config"]["data"],
          "the chat template file goes into the ConfigMap")
    check(cfg["security"]["ca"] == "/etc/tandem/secret/ca.pem" and
          cfg["router"]["tls_cert"] == "/etc/tandem/secret/http.pem",
          "security and router TLS files move to the Secret's mount")
    check("Secret every-secret" in err and "ca.pem" in err, "stderr names the Secret to create")
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    check(all(any(v["name"] == "secret" and v["secret"]["secretName"] == "every-secret"
                  for v in p["volumes"]) for p in pods), "every pod mounts the Secret")
    rt = objs["Deployment"]["every-router"]["spec"]["template"]
    check(rt["spec"]["containers"][0]["readinessProbe"]["httpGet"].get("scheme") == "HTTPS" and
          rt["metadata"]["annotations"].get("prometheus.io/scheme") == "https",
          "router TLS: probes and scraping over https")
    check(cfg["router"]["membership"]["lease_ms"] == 4000, "membership.lease_ms kept")
    sts = objs["StatefulSet"]["every-d0"]  # instance D0: a DNS-safe object name
    init = sts["spec"]["template"]["spec"]["initContainers"][0]["command"]
    check(init.count("llama.gguf") == 1, "the model and its draft (the same file) fetched once")
    check("every-pre-fill-a" in objs["Deployment"], "prefill pre_fill.A -> every-pre-fill-a")
    shm = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "shm"][0]
    kv = decode_kv(shape, {"tp": 2, "kv_blocks": 512, "block_size": 32, "kv_dtype": "f32"})
    check(shm["emptyDir"]["sizeLimit"] == mib(kv + 64 * MIB),
          f"d0's /dev/shm holds rank 1's KV pool + 64 MiB ({mib(kv + 64 * MIB)})")

    # the Secret's files need not be where the render runs (they are the cluster's): a
    # security section naming files that are not here renders, and they move to the mount
    with open(os.path.join(a.source_dir, "deploy/k8s.yaml")) as f:
        text = f.read()
    away = os.path.join(tmp, "not-here")
    path = os.path.join(tmp, "secured.yaml")
    with open(path, "w") as f:
        f.write(text + f"security:\n  ca: {away}/ca.pem\n  cert: {away}/node.pem\n"
                       f"  key: {away}/node.key\n")
    r = render(a.tandem, path, "--name", "sec", "--quiet")
    cfg = cfg_of(load_all(r.stdout))[1] if r.returncode == 0 else {}
    check(r.returncode == 0 and cfg.get("security", {}).get("key") == "/etc/tandem/secret/node.key",
          "security files absent here: the render still writes the manifests, the files under "
          f"the Secret's mount ({r.stderr.strip()[-300:]})")


def case_errors(a, tmp):
    def bad(args, needle, what):
        r = subprocess.run([a.tandem, "k8s", *args], capture_output=True, text=True, timeout=60)
        check(r.returncode == 1 and needle in r.stderr and r.stdout == "",
              f"{what}: exit 1, stderr says {needle!r} (got {r.returncode}: {r.stderr.strip()[:200]})")

    missing = os.path.join(tmp, "missing.yaml")
    bad(["render", missing], f"{missing}:1:1: cannot open", "a missing file")
    p = os.path.join(tmp, "broken.yaml")
    with open(p, "w") as f:
        f.write("model: x\ndecode: [\n")
    bad(["render", p], f"{p}:3:1: yaml:", "invalid YAML")
    with open(p, "w") as f:
        f.write("model: x\ndecode:\n  - name: d0\n    tq: 2\n")
    bad(["render", p], "unknown key 'tq'", "an unknown key")
    with open(p, "w") as f:  # a dp group's object is named after the group
        f.write("model: x\ndecode:\n  - name: d0\n    dp: 2\n  - name: D0\n")
    bad(["render", p], "two instances make the same Kubernetes name 'd0'",
        "a dp group and an instance of one DNS name")
    with open(p, "w") as f:
        f.write("model: x\ndecode:\n  - name: router\n")
    bad(["render", p], "taken by the broken-router object", "an instance named like an object")
    k8s = os.path.join(a.source_dir, "deploy/k8s.yaml")
    bad(["render", k8s, "--name", "Not_DNS"], "not a DNS label", "a bad --name")
    bad(["render", k8s, "--name", "x" * 50], "longer than 46 bytes", "a name too long for pods")
    bad(["render", k8s, "--grace", "0"], "--grace", "a bad --grace")
    bad(["render", k8s, "--bogus"], "unexpected argument '--bogus'", "an unknown option")
    bad(["render"], "a cluster YAML file is needed", "no file")
    bad(["frobnicate"], "unknown subcommand 'frobnicate'", "an unknown subcommand")
    bad(["render", k8s, "--out", "/proc/none/x"], "cannot create /proc/none/x", "an --out DIR "
        "that cannot be made")


def health(a, *args):
    r = subprocess.run([a.tandem, "health", *args], capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout + r.stderr


def case_health(a, tmp):
    if not a.decode or not os.access(a.decode, os.X_OK):
        print("SKIP: no tandem-decode")
        return 77
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    rc, out = health(a, "--timeout-ms", "500", url)
    check(rc == 1 and "no answer" in out, f"nothing on {url}: exit 1 ({out.strip()})")
    rc, out = health(a, "--timeout-ms", "500", f"http://127.0.0.1:{port}")
    check(rc == 1 and "no answer" in out, f"nothing on http: exit 1 ({out.strip()})")
    rc, out = health(a)
    check(rc == 1 and "usage" in out, "no URL: exit 1 with the usage")
    cfgp = os.path.join(tmp, "health.yaml")
    with open(cfgp, "w") as f:
        f.write(f"model: {os.path.join(a.synth_dir, 'llama.gguf')}\nrun_dir: {tmp}/run\n"
                f"decode:\n  - name: d0\n    port: {port}\n    kv_blocks: 64\n")
    log = open(os.path.join(tmp, "decode.log"), "w")
    p = subprocess.Popen([a.decode, "--config", cfgp, "--instance", "d0", "--rank", "0"],
                         stdout=log, stderr=subprocess.STDOUT)
    try:
        t0, rc = time.time(), 1
        while time.time() - t0 < 120 and p.poll() is None:
            rc, out = health(a, "--config", cfgp, url)
            if rc == 0:
                break
            time.sleep(0.5)
        check(rc == 0 and "ready" in out, f"a decode instance: ready ({out.strip()})")
        rc, out = health(a, "--alive", url)
        check(rc == 0, "--alive: exit 0")
    finally:
        p.terminate()
        p.wait(timeout=60)
    rc, out = health(a, "--timeout-ms", "500", url)
    check(rc == 1, f"after SIGTERM: exit 1 ({out.strip()})")
    # tp 2 with rank 0 alone: it answers, not ready (readiness fails, liveness holds) until
    # rank 1 joins
    with open(cfgp, "w") as f:
        f.write(f"model: {os.path.join(a.synth_dir, 'llama.gguf')}\nrun_dir: {tmp}/run\n"
                f"decode:\n  - name: d0\n    tp: 2\n    port: {port}\n    kv_blocks: 64\n")
    procs = [subprocess.Popen([a.decode, "--config", cfgp, "--instance", "d0", "--rank", "0"],
                              stdout=log, stderr=subprocess.STDOUT)]
    try:
        t0, rc = time.time(), 1
        while time.time() - t0 < 120 and rc != 0:
            rc, out = health(a, "--alive", url)
        check(rc == 0 and "not ready" in out, f"tp 2, rank 0 alone: --alive exit 0 ({out.strip()})")
        rc, out = health(a, url)
        check(rc == 1 and "not ready" in out, f"tp 2, rank 0 alone: exit 1 ({out.strip()})")
        procs.append(subprocess.Popen([a.decode, "--config", cfgp, "--instance", "d0", "--rank",
                                       "1"], stdout=log, stderr=subprocess.STDOUT))
        t0, rc = time.time(), 1
        while time.time() - t0 < 120 and rc != 0:
            rc, out = health(a, url)
            time.sleep(0.2)
        check(rc == 0, f"tp 2, both ranks: ready ({out.strip()})")
    finally:
        for q in procs:
            q.terminate()
        for q in procs:
            q.wait(timeout=60)
    return None


def http_json(port, method, path, body=None, timeout=60):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(method, path, body=json.dumps(body) if body is not None else None,
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        return r.status, json.loads(data) if data else None
    except (OSError, ValueError):
        return 0, None
    finally:
        c.close()


def case_dp_pod(a, tmp):
    """A data-parallel group (decode[].dp 2, the synthetic qwen3moe model) rendered into one
    pod, then that pod run here as its containers would run: the rendered command lines
    (binaries from the build, $(POD_NAME) / $(POD_IP) filled in, the ConfigMap's YAML with
    the pod paths pointed here), the router from its Deployment's command; the members form
    their group through the pod's shared memory, join the router as POD.0 and POD.1 through
    membership, each member's rendered readiness probe passes, and concurrent requests are
    answered by both members with the same greedy text."""
    if not a.decode or not a.router or not os.access(a.router, os.X_OK):
        print("SKIP: no tandem-decode or tandem-router")
        return 77
    http_port, mport, dport = free_port(), free_port(), free_port(2)  # members at dport + k
    path = os.path.join(tmp, "dp.yaml")
    with open(path, "w") as f:
        f.write(f"model: {os.path.join(a.synth_dir, 'qwen3moe.gguf')}\n"
                f"router:\n  listen: 127.0.0.1:{http_port}\n"
                f"  membership:\n    listen: 127.0.0.1:{mport}\n    lease_ms: 3000\n"
                f"decode:\n  - name: d0\n    dp: 2\n    port: {dport}\n    kv_blocks: 128\n"
                "    deterministic: true\n")  # one text whatever the batching
    r = render(a.tandem, path, "--name", "dpk", "--quiet")
    if not check(r.returncode == 0, f"dp 2: rendered ({r.stderr.strip()[-300:]})"):
        return None
    docs = load_all(r.stdout)
    validate(docs, "dp 2")
    objs = by_kind(docs)
    sts = objs["StatefulSet"].get("dpk-d0")
    if not check(sts is not None and list(objs["StatefulSet"]) == ["dpk-d0"],
                 "dp 2: one StatefulSet dpk-d0 for the group"):
        return None
    pod = sts["spec"]["template"]["spec"]
    cs = pod["containers"]
    check([c["name"] for c in cs] == ["m0-rank-0", "m1-rank-0"], "dp 2: a container per member")
    for k, c in enumerate(cs):
        want = ["tandem-decode", "--config", "/etc/tandem/cluster.yaml", "--instance", f"d0.{k}",
                "--rank", "0", "--name", f"$(POD_NAME).{k}", "--advertise", "$(POD_IP)",
                "--listen", f"tcp://0.0.0.0:{dport + k}"]
        check(c["command"] == want, f"dp 2: member {k}: {' '.join(c['command'])}")
        check(c["ports"] == [{"name": f"control-{k}", "containerPort": dport + k,
                              "protocol": "TCP"}] and
              probe_cmd(c, "readinessProbe")[-1] == f"tcp://127.0.0.1:{dport + k}",
              f"dp 2: member {k}: its port and probes")
    svc = objs["Service"]["dpk-d0"]["spec"]
    check([(p_["name"], p_["port"]) for p_ in svc["ports"]] ==
          [("control-0", dport), ("control-1", dport + 1)] and svc["clusterIP"] == "None",
          "dp 2: the headless Service names both members' ports")
    check(pod.get("shareProcessNamespace") is True and
          any(v["name"] == "shm" and v["emptyDir"].get("medium") == "Memory"
              for v in pod["volumes"]), "dp 2: shared pids and /dev/shm")

    # the pod, run here
    text = cfg_of(docs)[0]
    cache = os.path.join(tmp, "cache")
    os.makedirs(cache, exist_ok=True)
    text = (text.replace("/models/", a.synth_dir + "/").replace("/var/cache/tandem", cache)
            .replace("dpk-join:", "127.0.0.1:"))
    cfgp = os.path.join(tmp, "cluster.yaml")
    with open(cfgp, "w") as f:
        f.write(text)
    bins = {"tandem-decode": a.decode, "tandem-router": a.router, "tandem": a.tandem}
    subst = {"$(POD_NAME)": "dpk-d0-0", "$(POD_IP)": "127.0.0.1",
             "/etc/tandem/cluster.yaml": cfgp}

    def local(cmd):
        out = [bins.get(cmd[0], cmd[0])]
        for arg in cmd[1:]:
            for k, v in subst.items():
                arg = arg.replace(k, v)
            out.append(arg)
        return out

    env = dict(os.environ, TANDEM_CACHE=cache)
    rt_cmd = objs["Deployment"]["dpk-router"]["spec"]["template"]["spec"]["containers"][0]["command"]
    procs, logs = [], {}
    try:
        for name, cmd in [("router", rt_cmd)] + [(c["name"], c["command"]) for c in cs]:
            logs[name] = os.path.join(tmp, f"{name}.log")
            procs.append(subprocess.Popen(local(cmd), env=env, stdout=open(logs[name], "w"),
                                          stderr=subprocess.STDOUT))
        t0, ready = time.time(), [False, False]
        while time.time() - t0 < 120 and not all(ready):
            for k, c in enumerate(cs):
                if not ready[k]:
                    ready[k] = subprocess.run(local(probe_cmd(c, "readinessProbe")),
                                              capture_output=True, env=env,
                                              timeout=60).returncode == 0
            time.sleep(0.3)
        check(all(ready), f"dp 2: each member's rendered readiness probe passes ({ready})")
        members = {f"dpk-d0-0.{k}": f"tcp://127.0.0.1:{dport + k}" for k in range(2)}
        live = {}
        while time.time() - t0 < 120:
            st, inst = http_json(http_port, "GET", "/instances")
            live = {i["name"]: i for i in (inst or {}).get("decode", [])} if st == 200 else {}
            if all(live.get(m, {}).get("alive") for m in members):
                break
            time.sleep(0.3)
        check(all(live.get(m, {}).get("joined") and live[m].get("alive") and live[m]["url"] == u
                  for m, u in members.items()),
              f"dp 2: the members joined as POD.0 and POD.1 at their ports ({live})")
        grp = open(logs["m0-rank-0"]).read()
        check("member 0 of dp group d0 (2 members)" in grp, "dp 2: the group formed in the pod")
        body = {"messages": [{"role": "user", "content": "count: one two three"}],
                "max_tokens": 12, "temperature": 0}
        res = [None] * 8

        def ask(i):
            res[i] = http_json(http_port, "POST", "/v1/chat/completions", body, timeout=120)

        ts = [threading.Thread(target=ask, args=(i,)) for i in range(len(res))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        texts = {r_[1]["choices"][0]["message"]["content"] for r_ in res
                 if r_ and r_[0] == 200 and r_[1]}
        check(all(r_ and r_[0] == 200 for r_ in res) and len(texts) == 1,
              f"dp 2: {len(res)} concurrent requests answered, one greedy text ({texts})")
        rlog = open(logs["router"]).read()
        served = {m for m in ("dpk-d0-0.0", "dpk-d0-0.1") if f"decode {m}" in rlog}
        check(len(served) == 2, f"dp 2: both members served requests ({sorted(served)})")
    finally:
        for q in procs:
            q.terminate()
        for q in procs:
            try:
                q.wait(timeout=60)
            except subprocess.TimeoutExpired:
                q.kill()
                q.wait()
    rcs = {name: q.returncode for name, q in zip(logs, procs)}
    check(all(rc == 0 for rc in rcs.values()), f"dp 2: every process exits 0 on SIGTERM ({rcs})")
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True, choices=["render", "errors", "health", "dp_pod"])
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--decode")
    ap.add_argument("--router")
    ap.add_argument("--synth-dir", required=True)
    ap.add_argument("--source-dir", required=True)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tandem-k8s-")
    try:
        rc = {"render": case_render, "errors": case_errors, "health": case_health,
              "dp_pod": case_dp_pod}[a.case](a, tmp)
        if rc == 77:
            return 77
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summary()


if __name__ == "__main__":
    sys.exit(main())
