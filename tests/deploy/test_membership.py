#!/usr/bin/env python3
"""test_membership.py: instances that join and leave a running cluster (router.membership,
docs/deploy.md "Membership"), with real processes on loopback and streaming load throughout.

Cases (--case, one ctest each):
  decode   router + decode d0 from the YAML (membership on, max_instances 3, lease 1.5 s,
           d0 with drain_timeout_ms); 4 streaming clients all along:
             - d1 (template d0, --name d1) joins: the router says so, and d1 takes requests
             - d0 gets SIGTERM: it drains (Health.draining: no new requests, those in flight
               finish in place: none moves), exits 0; the load goes on on d1
             - d2 joins, then d3 is refused (max_instances 3: "no room") and keeps
               announcing itself; d2 is killed (SIGKILL): the router marks it dead, forgets
               it after the lease, and d3's next announcement takes the slot: d3 serves
             - d1 restarts at another port under the same name: the router follows it
           every request of the load: 200 with a complete answer; /metrics lists the live
           set only (no d2 after it was forgotten), and so do GET /instances and
           `tandem status --instances`
  prefill  disaggregated: router + prefill p0 (pp 1, drain_timeout_ms) + decode d0 from the
           YAML; p1 (template p0) joins and prefills; p0 gets SIGTERM: it drains (its prompts
           finish in place, none starts again), new prompts go to p1; the load ends with every
           request answered
  netns    four hosts (network namespaces: the router's, two decode hosts, a prefill host),
           addresses by name only (/etc/netns/NS/hosts), the YAML's entries templates (seed
           false), every plane with credentials (https + API key, mutual TLS on the control
           sockets, keyed KV targets): decode-b joins under load and takes requests, decode-a
           leaves drained; 0 failed requests, no request moved, every prompt prefilled on the
           prefill host; without the credentials the router and a decode host refuse, and log
           it (needs root and openssl: skipped otherwise)

usage: test_membership.py --case decode|prefill|netns --decode BIN --router BIN [--prefill BIN]
                          [--tandem BIN] --model GGUF
"""
import argparse
import http.client
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import ssl
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from tdtest.checks import check, context, summary  # noqa: E402
from tdtest.cluster import parse_metrics, write_yaml  # noqa: E402
from tdtest.ports import free_port  # noqa: E402
from tdtest.procs import Procs, read  # noqa: E402
from tdtest.waits import wait_for, wait_http, wait_text  # noqa: E402


class Load:
    """n streaming clients sending completions until stop(); results: (ok, detail) each."""

    def __init__(self, port, model, n=4, max_tokens=24, host="127.0.0.1", tls=None, key=""):
        self.port, self.model, self.n, self.max_tokens = port, model, n, max_tokens
        self.host, self.tls, self.key = host, tls, key  # tls: an ssl.SSLContext (https)
        self.results, self.stopping, self.threads = [], False, []

    def one(self, i, k):
        body = json.dumps({"model": self.model, "prompt": f"Request {i}-{k}: once upon a time",
                           "max_tokens": self.max_tokens, "temperature": 0, "stream": True,
                           "ignore_eos": True})
        c = http.client.HTTPSConnection(self.host, self.port, timeout=120, context=self.tls) \
            if self.tls else http.client.HTTPConnection(self.host, self.port, timeout=120)
        hdr = {"Content-Type": "application/json"}
        if self.key:
            hdr["Authorization"] = f"Bearer {self.key}"
        try:
            c.request("POST", "/v1/completions", body, hdr)
            r = c.getresponse()
            data = r.read().decode("utf-8", "replace")
            ok = r.status == 200 and data.rstrip().endswith("data: [DONE]") and \
                '"error"' not in data and '"finish_reason":"length"' in data
            return ok, f"status {r.status}: {data[-300:]}"
        except (OSError, http.client.HTTPException) as e:
            return False, f"{type(e).__name__}: {e}"
        finally:
            c.close()

    def run(self, i):
        k = 0
        while not self.stopping:
            self.results.append(self.one(i, k))
            k += 1

    def start(self):
        self.threads = [threading.Thread(target=self.run, args=(i,)) for i in range(self.n)]
        for t in self.threads:
            t.start()

    def stop(self):
        self.stopping = True
        for t in self.threads:
            t.join()

    def check(self, what):
        bad = [d for ok, d in self.results if not ok]
        check(len(self.results) > 0 and not bad,
              f"{what}: {len(self.results)} requests, {len(bad)} failed"
              + (f" (first: {bad[0]})" if bad else ""))


def term_wait(P, name, timeout=40):
    """SIGTERM to one process, its exit code once it ended (None: still there at timeout)."""
    P[name].send_signal(signal.SIGTERM)
    try:
        return P[name].wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def drained(P, name):
    """A node stopped without ending any request with an error: it left (drain_timeout_ms) or
    had nothing in flight ("... end with an error" is what a stop that fails requests logs)."""
    return "end with an error" not in P.log(name)


def metrics(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode())


def up_instances(port, family="tandem_instance_up"):
    """{instance: value} of a per-instance gauge."""
    out = {}
    for (name, labels), v in metrics(port).items():
        if name == family:
            out[dict(labels).get("instance")] = v
    return out


def served_by(router_log, name):
    """Requests the router's log says finished on decode (or prefill) instance name."""
    return len(re.findall(rf"status 200 .*(?:decode|prefill) {re.escape(name)}(?: |$)",
                          router_log, re.M))


def model_id(port, host="127.0.0.1", tls=None, key=""):
    rq = urllib.request.Request(f"{'https' if tls else 'http'}://{host}:{port}/v1/models",
                                headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(rq, timeout=10, context=tls) as r:
        return json.loads(r.read())["data"][0]["id"]


def base_yaml(a, d, http_port, member_port, d0_port):
    return {"model": a.model, "run_dir": os.path.join(d, "run"),
            "router": {"listen": f"127.0.0.1:{http_port}", "heartbeat_ms": 100,
                       "instance_timeout_ms": 1500, "migrate_wait_ms": 15000,
                       "membership": {"listen": f"127.0.0.1:{member_port}", "lease_ms": 1500,
                                      "max_instances": 3}},
            "decode": [{"name": "d0", "host": "127.0.0.1", "port": d0_port, "threads": 1,
                        "kv_blocks": 512, "max_batch": 8, "drain_timeout_ms": 20000}]}


def decode_argv(a, cfg, name, port):
    return [a.decode, "--config", cfg, "--instance", "d0", "--rank", "0", "--name", name,
            "--listen", f"tcp://127.0.0.1:{port}", "--advertise", "127.0.0.1"]


def case_decode(a, d, P):
    base = free_port(7)
    http_port, member_port, d0, d1, d1b, d2, d3 = range(base, base + 7)
    cfg = os.path.join(d, "cluster.yaml")
    write_yaml(cfg, base_yaml(a, d, http_port, member_port, d0))
    P.spawn("router", [a.router, "--config", cfg])
    P.spawn("d0", [a.decode, "--config", cfg, "--instance", "d0", "--rank", "0"])
    if not check(wait_http(http_port, timeout=120), "the router serves with d0"):
        return
    rlog = P.log_path("router")
    load = Load(http_port, model_id(http_port))
    load.start()
    try:
        t0 = time.time()
        P.spawn("d1", decode_argv(a, cfg, "d1", d1))
        check(wait_text(rlog, "decode instance d1 joined at tcp://127.0.0.1:", 60),
              "d1 joins (router log)")
        ok = wait_for(lambda: served_by(read(rlog), "d1") > 0, 60)
        check(ok, f"d1 takes requests (its first answered {time.time() - t0:.1f} s after its "
                  "process started)")
        check(wait_for(lambda: up_instances(http_port).get("d1") == 1, 10),
              "/metrics: d1 is up")

        n_moved = read(rlog).count("moved:")
        code = term_wait(P, "d0")
        check(drained(P, "d0"), "d0 drains on SIGTERM (nothing ended with an error)")
        check(code == 0, f"d0 exits 0 after its drain (exit {code})")
        check(read(rlog).count("moved:") == n_moved,
              "d0's requests finished in place (none moved)")
        t_left = served_by(read(rlog), "d1")
        check(wait_for(lambda: served_by(read(rlog), "d1") > t_left + 4, 60),
              "the load goes on on d1")

        P.spawn("d2", decode_argv(a, cfg, "d2", d2))
        check(wait_text(rlog, "decode instance d2 joined", 60), "d2 joins")
        P.spawn("d3", decode_argv(a, cfg, "d3", d3))
        check(wait_text(P.log_path("d3"), "refused: no room for another decode instance", 60),
              "d3 is refused while the set is full (max_instances 3), and says so")
        P.kill("d2")  # SIGKILL: no goodbye
        check(wait_text(rlog, "decode instance d2 (tcp://127.0.0.1:%d) forgotten" % d2, 30),
              "the router forgets the killed d2 after the lease")
        check(wait_text(rlog, "decode instance d3 joined", 30),
              "d3's next announcement takes the freed slot")
        check(wait_for(lambda: served_by(read(rlog), "d3") > 0, 60), "d3 takes requests")
        inst = up_instances(http_port)
        check("d2" not in inst and inst.get("d3") == 1 and inst.get("d1") == 1,
              f"/metrics lists the live set ({sorted(k for k in inst if k)})")
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/instances", timeout=10) as r:
            live = {x["name"]: x for x in json.loads(r.read())["decode"]}
        check(sorted(live) == ["d0", "d1", "d3"] and not live["d0"]["joined"] and
              not live["d0"]["alive"] and live["d3"]["joined"] and live["d3"]["alive"] and
              live["d1"]["url"] == f"tcp://127.0.0.1:{d1}",
              f"GET /instances: the YAML's d0 (gone) and the members d1, d3 ({live})")
        if a.tandem:
            out = subprocess.run([a.tandem, "status", cfg, "--instances"], capture_output=True,
                                 text=True, timeout=60).stdout.splitlines()
            rows = {ln.split()[1]: ln.split() for ln in out if ln.split()[:1] == ["decode"]}
            check(sorted(rows) == ["d0", "d1", "d3"] and rows["d3"][3:5] == ["serving", "joined"]
                  and rows["d0"][3:5] == ["dead", "yaml"],
                  f"tandem status --instances prints the live set ({out})")
            js = subprocess.run([a.tandem, "status", cfg, "--instances", "--json"],
                                capture_output=True, text=True, timeout=60).stdout
            check(sorted(x["name"] for x in json.loads(js)["decode"]) == ["d0", "d1", "d3"],
                  "tandem status --instances --json: the router's JSON")

        P.kill("d1", signal.SIGTERM)
        P.spawn("d1", decode_argv(a, cfg, "d1", d1b))
        check(wait_text(rlog, f"decode instance d1 moved from tcp://127.0.0.1:{d1} to "
                              f"tcp://127.0.0.1:{d1b}", 60),
              "d1 restarted at another port: the router follows it")
        t_d1 = served_by(read(rlog), "d1")
        check(wait_for(lambda: served_by(read(rlog), "d1") > t_d1, 60),
              "d1 serves at its new address")

        # a member that leaves is forgotten at once (its leaving Join); an address the router
        # cannot keep (longer than its 160 bytes) is refused with the reason
        P.kill("d3", signal.SIGTERM)
        check(wait_text(rlog, "decode instance d3 (tcp://127.0.0.1:%d) forgotten: it left" % d3,
                        30), "d3 leaves and is forgotten at once (it said so)")
        argv = decode_argv(a, cfg, "dlong", d2)
        argv[argv.index("--advertise") + 1] = "h" * 170
        P.spawn("dlong", argv)
        check(wait_text(P.log_path("dlong"), "refused: cannot add it", 60),
              "an instance whose address is too long is refused, and says why")
        P.kill("dlong", signal.SIGTERM)
        check(P["router"].poll() is None, "the router is still there")
    finally:
        load.stop()
    load.check("the load through joins, a drain, a kill and a move")


def case_prefill(a, d, P):
    if not a.prefill:
        print("skipped: no tandem-prefill")
        sys.exit(77)
    base = free_port(5)
    http_port, member_port, d0, p0, p1 = range(base, base + 5)
    doc = base_yaml(a, d, http_port, member_port, d0)
    doc["prefill"] = [{"name": "p0", "pp": 1, "threads": 1, "hosts": ["127.0.0.1"],
                       "port": p0, "kv_tokens": 4096, "profile_budget_ms": 0,
                       "chunk_size": 64, "drain_timeout_ms": 20000}]
    doc["kvxfer"] = {"ucx_tls": "tcp,self", "timeout_ms": 20000}
    cfg = os.path.join(d, "cluster.yaml")
    write_yaml(cfg, doc)
    P.spawn("router", [a.router, "--config", cfg])
    P.spawn("d0", [a.decode, "--config", cfg, "--instance", "d0", "--rank", "0"])
    P.spawn("p0", [a.prefill, "--config", cfg, "--instance", "p0", "--stage", "0"])
    if not check(wait_http(http_port, timeout=180), "the router serves with p0 and d0"):
        return
    rlog = P.log_path("router")
    load = Load(http_port, model_id(http_port))
    load.start()
    try:
        t0 = time.time()
        P.spawn("p1", [a.prefill, "--config", cfg, "--instance", "p0", "--stage", "0",
                       "--name", "p1", "--listen", f"tcp://127.0.0.1:{p1}",
                       "--advertise", "127.0.0.1"])
        check(wait_text(rlog, "prefill instance p1 joined at tcp://127.0.0.1:", 120),
              "p1 joins (router log)")
        ok = wait_for(lambda: served_by(read(rlog), "p1") > 0, 120)
        check(ok, f"p1 prefills prompts (the first answered {time.time() - t0:.1f} s after its "
                  "process started)")
        code = term_wait(P, "p0")
        check(code == 0, f"p0 exits 0 on SIGTERM (exit {code})")
        check(drained(P, "p0"),
              "p0 drained (prefill[].drain_timeout_ms): its prompts finished in place")
        bad = [ln for ln in read(rlog).splitlines()
               if "prefill instance p0" in ln and ("failed before" in ln or "lost before" in ln)]
        check(not bad, f"no prompt of p0 had to start again ({bad[:2]})")
        t_p1 = served_by(read(rlog), "p1")
        check(wait_for(lambda: served_by(read(rlog), "p1") > t_p1 + 4, 60),
              "the load goes on through p1")
    finally:
        load.stop()
    load.check("the load through a prefill join and a prefill leaving")


def sh(*argv, check_rc=True):
    p = subprocess.run(list(argv), capture_output=True, text=True)
    if check_rc and p.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {p.stderr.strip()}")
    return p


def case_netns(a, d, P):
    """Four hosts as network namespaces: the router's (R, linked to the root namespace where
    the clients are), two decode hosts (A, B) and a prefill host (X), each linked to R only
    (R forwards between them: the KV goes X -> R -> A or B). Every address is a name from the
    namespace's own /etc/hosts (/etc/netns/NS/hosts, which `ip netns exec` mounts): the nodes
    announce themselves to tandem-router:PORT as decode-a / decode-b / prefill-x, and the
    YAML's entries are templates only (membership.seed false, the Kubernetes case). Every
    plane has credentials: the router serves https with an API key, every control socket is
    mutual TLS (the YAML's security section), the KV plane's targets carry their keys over it.
    Under load B joins and takes requests, A leaves (SIGTERM, drained): 0 failures, every
    prompt prefilled on X. Then, without the credentials: plain http and https without the
    key are refused by the router, and a client without the cluster's certificate gets no
    answer from the router's membership socket nor from a decode host, whose logs say so.
    (The KV plane's refusals need a process that speaks UCX: tests/kvxfer, test_kvx_2proc's
    test_unkeyed_writer and test_kvx_pipe's test_ucx_tcp_put_unkeyed, between processes.)"""
    if shutil.which("ip") is None:
        print("skipped: no 'ip' command")
        sys.exit(77)
    if not a.prefill or not a.tandem:
        print("skipped: needs tandem-prefill and tandem")
        sys.exit(77)
    certs = os.path.join(d, "certs")
    src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(["sh", os.path.join(src, "ctrl", "make_certs.sh"), certs])
    if r.returncode == 77:
        print("skipped: openssl is not installed (Debian package openssl)")
        sys.exit(77)
    if not check(r.returncode == 0, "make_certs.sh made the certificates"):
        return
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    ns = {"r": f"tmr{tag}", "a": f"tma{tag}", "b": f"tmb{tag}", "x": f"tmx{tag}"}
    probe = subprocess.run(["ip", "netns", "add", ns["r"]], capture_output=True, text=True)
    if probe.returncode:
        print(f"skipped: 'ip netns add' is not permitted here ({probe.stderr.strip()})")
        sys.exit(77)
    made_etc = []
    try:
        for k in ("a", "b", "x"):
            sh("ip", "netns", "add", ns[k])
        used = sh("ip", "-4", "addr").stdout
        n = next(n for n in random.sample(range(1, 250), 249) if f"10.78.{n}." not in used)
        net = f"10.78.{n}"
        # root <-> R: .1 / .2; R <-> A: .5 / .6; R <-> B: .9 / .10; R <-> X: .13 / .14
        links = [(None, ns["r"], f"{net}.1", f"{net}.2", "c"),
                 (ns["r"], ns["a"], f"{net}.5", f"{net}.6", "a"),
                 (ns["r"], ns["b"], f"{net}.9", f"{net}.10", "b"),
                 (ns["r"], ns["x"], f"{net}.13", f"{net}.14", "x")]
        for left, right, ip_l, ip_r, x in links:
            va, vb = f"tm{x}{tag}a", f"tm{x}{tag}b"
            sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
            if left:
                sh("ip", "link", "set", va, "netns", left)
            sh("ip", "link", "set", vb, "netns", right)
            pre = ["ip", "-n", left] if left else ["ip"]
            sh(*pre, "addr", "add", f"{ip_l}/30", "dev", va)
            sh(*pre, "link", "set", va, "up")
            sh("ip", "-n", right, "addr", "add", f"{ip_r}/30", "dev", vb)
            sh("ip", "-n", right, "link", "set", vb, "up")
            if left:  # the host's way to the others: through R
                sh("ip", "-n", right, "route", "add", "default", "via", ip_l)
        for k in ns:
            sh("ip", "-n", ns[k], "link", "set", "lo", "up")
        sh("ip", "netns", "exec", ns["r"], "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        hosts = {"r": f"{net}.6 decode-a\n{net}.10 decode-b\n{net}.14 prefill-x\n",
                 "a": f"{net}.5 tandem-router\n{net}.6 decode-a\n",
                 "b": f"{net}.9 tandem-router\n{net}.10 decode-b\n",
                 "x": f"{net}.13 tandem-router\n{net}.14 prefill-x\n"}
        for k, text in hosts.items():
            dd = f"/etc/netns/{ns[k]}"
            os.makedirs(dd, exist_ok=True)
            made_etc.append(dd)
            with open(os.path.join(dd, "hosts"), "w") as f:
                f.write("127.0.0.1 localhost\n" + text)
        http_port, member_port, dport, pport = 8000, 9300, 9000, 9100  # ports per namespace
        pem = lambda n: os.path.join(certs, n)  # noqa: E731
        key = "sk-netns-test"
        doc = base_yaml(a, d, http_port, member_port, dport)
        doc["router"]["listen"] = f"0.0.0.0:{http_port}"
        doc["router"].update({"api_key": key, "tls_cert": pem("node.pem"),
                              "tls_key": pem("node.key")})
        doc["router"]["membership"] = {"listen": f"0.0.0.0:{member_port}",
                                       "address": f"tandem-router:{member_port}",
                                       "lease_ms": 1500, "seed": False}
        doc["prefill"] = [{"name": "p0", "pp": 1, "threads": 1, "hosts": ["127.0.0.1"],
                           "port": pport, "kv_tokens": 4096, "profile_budget_ms": 0,
                           "chunk_size": 64}]
        doc["kvxfer"] = {"ucx_tls": "tcp,self", "timeout_ms": 20000}
        doc["security"] = {"ca": pem("ca.pem"), "cert": pem("node.pem"), "key": pem("node.key")}
        cfg = os.path.join(d, "cluster.yaml")
        write_yaml(cfg, doc)
        tls = ssl.create_default_context(cafile=pem("ca.pem"))
        tls.check_hostname = False  # the certificate names 127.0.0.1; the router is 10.78.N.2
        inns = lambda k, argv: ["ip", "netns", "exec", ns[k], *argv]  # noqa: E731
        node = lambda name: [a.decode, "--config", cfg, "--instance", "d0", "--rank", "0",  # noqa
                             "--name", name, "--listen", f"tcp://0.0.0.0:{dport}",
                             "--advertise", name]
        P.spawn("router", inns("r", [a.router, "--config", cfg]))
        P.spawn("prefill-x", inns("x", [a.prefill, "--config", cfg, "--instance", "p0",
                                        "--stage", "0", "--name", "prefill-x", "--listen",
                                        f"tcp://0.0.0.0:{pport}", "--advertise", "prefill-x"]))
        P.spawn("decode-a", inns("a", node("decode-a")))
        base = f"https://{net}.2:{http_port}"
        rlog = P.log_path("router")
        ok = wait_for(lambda: http_ok(base + "/health", tls), 180, step=0.3) and \
            wait_text(rlog, "prefill instance prefill-x joined at tls+tcp://prefill-x:", 60)
        if not check(ok, f"router in {ns['r']} serves https with decode-a ({ns['a']}) and "
                         f"prefill-x ({ns['x']}), found by name"):
            return
        check("decode instance decode-a joined at tls+tcp://decode-a:" in read(rlog),
              "decode-a joined under its name, at a name")
        for k in ("decode-a", "prefill-x"):
            check("kvx ucx: network devices tm" in P.log(k),
                  f"{k}'s KV plane is on its own host's device, not the template's "
                  f"({[ln for ln in P.log(k).splitlines() if 'network devices' in ln][:1]})")
        load = Load(http_port, model_id(http_port, f"{net}.2", tls, key), host=f"{net}.2",
                    tls=tls, key=key)
        load.start()
        try:
            t0 = time.time()
            P.spawn("decode-b", inns("b", node("decode-b")))
            check(wait_text(rlog, "decode instance decode-b joined at tls+tcp://decode-b:", 60),
                  "decode-b joins from another host")
            ok = wait_for(lambda: served_by(read(rlog), "decode-b") > 0, 60)
            check(ok, f"decode-b takes requests ({time.time() - t0:.1f} s after its start)")
            code = term_wait(P, "decode-a")
            check(code == 0 and drained(P, "decode-a"),
                  f"decode-a leaves on SIGTERM, drained (exit {code})")
            t_b = served_by(read(rlog), "decode-b")
            check(wait_for(lambda: served_by(read(rlog), "decode-b") > t_b + 4, 60),
                  "the load goes on on decode-b")
        finally:
            load.stop()
        load.check("the load across hosts through a join and a leave")
        check("moved:" not in read(rlog), "no request had to move (decode-a drained in place)")
        # the router logs a request's line when the request ends, which can be a moment after
        # the client read its last chunk (one CI run counted 25 of 26: the line came later)
        n_all = len(load.results)
        wait_for(lambda: served_by(read(rlog), "prefill-x") >= n_all, 10)
        n_pf = served_by(read(rlog), "prefill-x")
        check(n_pf >= n_all, f"every prompt was prefilled on prefill-x and its KV crossed hosts "
                             f"({n_pf} of {n_all})")

        # without the credentials, at every plane the root namespace reaches
        st = http_status(f"http://{net}.2:{http_port}/v1/models")
        check(st != 200, f"plain http to the router: no answer ({st})")
        st = http_status(f"{base}/v1/models", tls)
        check(st == 401, f"https without the API key: 401 ({st})")
        for what, url, log in (("the router's membership socket",
                                f"tcp://{net}.2:{member_port}", rlog),
                               ("decode-b's control socket", f"tcp://decode-b:{dport}",
                                P.log_path("decode-b"))):
            argv = [a.tandem, "client", "--url", url, "--health", "--timeout-ms", "3000"]
            r = subprocess.run(inns("r", argv), capture_output=True, text=True, timeout=60)
            check(r.returncode != 0 and "ready" not in r.stdout,
                  f"{what} without a certificate: no answer ({r.returncode} {r.stdout.strip()})")
            check(wait_for(lambda: "TLS handshake failed" in read(log), 15),
                  f"{what}: the refusal is logged")
            tlsargs = ["--tls-ca", pem("ca.pem"), "--tls-cert", pem("node.pem"), "--tls-key",
                       pem("node.key")]
            r = subprocess.run(inns("r", argv + tlsargs), capture_output=True, text=True,
                               timeout=60)
            check(r.returncode == 0, f"{what} with the cluster's certificate answers "
                                     f"({r.returncode} {r.stdout.strip()} {r.stderr[-200:]})")
    finally:
        P.stop(timeout=30)
        for k in ns:
            for pid in sh("ip", "netns", "pids", ns[k], check_rc=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
            sh("ip", "netns", "del", ns[k], check_rc=False)
        sh("ip", "link", "del", f"tmc{tag}a", check_rc=False)
        for dd in made_etc:
            shutil.rmtree(dd, ignore_errors=True)
        left = sh("ip", "netns", "list", check_rc=False).stdout
        check(not any(ns[k] in left for k in ns), "namespaces removed")


def http_ok(url, tls=None):
    try:
        with urllib.request.urlopen(url, timeout=5, context=tls) as r:
            return r.status == 200
    except OSError:
        return False


def http_status(url, tls=None, key=""):
    """The HTTP status of GET url, or the exception's name when no HTTP answer came."""
    rq = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(rq, timeout=10, context=tls) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, http.client.HTTPException) as e:
        return type(e).__name__


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True, choices=["decode", "prefill", "netns"])
    ap.add_argument("--decode", required=True)
    ap.add_argument("--router", required=True)
    ap.add_argument("--prefill", default="")
    ap.add_argument("--tandem", default="", help="the tandem CLI (status --instances)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs)")
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="tandem-member-")
    P = Procs(d)
    context(f"logs in {d}")
    try:
        {"decode": case_decode, "prefill": case_prefill, "netns": case_netns}[a.case](a, d, P)
    finally:
        codes = P.stop(timeout=30)
        print("exit codes:", codes)
        if not a.keep and not summary():
            shutil.rmtree(d, ignore_errors=True)
            return 0
    return summary()


if __name__ == "__main__":
    sys.exit(main())
