#!/usr/bin/env python3
"""test_router_tls.py: tandem-router's TLS listener (router.tls_cert, tls_key, tls_client_ca),
one tp1 decode instance on the synthetic model. A throwaway CA, a second CA, a server
certificate (127.0.0.1) and client certificates are made with openssl in a temp directory
(the test is skipped, exit 77, without /usr/bin/openssl). Cases:
  tls      https: /health, a chat completion and a stream (Python's ssl, verifying the CA),
           curl --cacert, api_key over TLS (401 without or with a wrong key, 200 with it),
           a client trusting another CA refuses the router, plain HTTP on the TLS port gets
           no HTTP answer (and the router serves on), the start-up log says https
  mtls     tls_client_ca: no client certificate and one from another CA get no HTTP answer,
           one from the CA is served (Python and curl); `tandem bench` over https with
           --cacert/--cert/--key, with CURL_CA_BUNDLE, and failing against the wrong CA; the
           router's own certificate as a client (what `tandem up`'s health probe presents)
  up       `tandem up -d` of a cluster with tls_client_ca: ready (its probe presents the
           router's certificate), https endpoint, served, `tandem down`
  config   start-up errors naming the key and the file: tls_cert alone, an unreadable key,
           a certificate file that is not PEM, a key that is not the certificate's, a client
           CA file without a certificate (the router exits 1)

usage: test_router_tls.py --router BIN --decode BIN --tandem BIN --synth GGUF [--case C]
"""
import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
from rtlib import Cluster  # noqa: E402
from tdtest.checks import FAILS, check  # noqa: E402
from tdtest.cluster import write_yaml  # noqa: E402
from tdtest.ports import free_port  # noqa: E402
from tdtest.waits import wait_text  # noqa: E402

OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"
KEY = "sk-tls-test"


def openssl(*argv, cwd):
    subprocess.run([OPENSSL, *argv], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d, name):
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
            "-subj", f"/CN=tandem test {name}", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)


def make_cert(d, name, ca, ext):
    """name.pem / name.key signed by ca, with the extensions in ext (openssl x509 -extfile)."""
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=tandem test {name}",
            cwd=d)
    with open(os.path.join(d, f"{name}.ext"), "w") as f:
        f.write(ext)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-set_serial", str(abs(hash(name)) % 100000 + 2), "-out", f"{name}.pem", "-days",
            "2", "-extfile", f"{name}.ext", cwd=d)


def make_pki(d):
    """ca (the router's and its clients'), other (a CA nobody trusts), server (127.0.0.1,
    from ca), client (from ca), stranger (a client certificate from other)."""
    make_ca(d, "ca")
    make_ca(d, "other")
    make_cert(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
              "extendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature\n")
    make_cert(d, "client", "ca", "extendedKeyUsage=clientAuth\n"
              "keyUsage=critical,digitalSignature\n")
    make_cert(d, "stranger", "other", "extendedKeyUsage=clientAuth\n"
              "keyUsage=critical,digitalSignature\n")
    return {n: os.path.join(d, n) for n in ("ca", "other", "server", "client", "stranger")}


def ctx(pki, ca="ca", client=None):
    c = ssl.create_default_context(cafile=pki[ca] + ".pem")
    if client:
        c.load_cert_chain(pki[client] + ".pem", pki[client] + ".key")
    return c


def https(port, context, method, path, body=None, key=None, timeout=60):
    """(status, body bytes) of one request over TLS; raises what the TLS layer raises."""
    c = http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout, context=context)
    h = {"Content-Type": "application/json"} if body is not None else {}
    if key:
        h["Authorization"] = f"Bearer {key}"
    try:
        c.request(method, path, json.dumps(body) if body is not None else None, h)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def refused(port, context):
    """A request that must get no HTTP answer: (True, why) when the TLS layer (or the
    connection) failed; (False, status) when an HTTP status came back."""
    try:
        st, _ = https(port, context, "GET", "/health", timeout=20)
        return False, f"HTTP {st}"
    except (ssl.SSLError, ConnectionError, http.client.HTTPException, OSError) as e:
        return True, f"{type(e).__name__}: {e}"


CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8,
        "temperature": 0}


class TlsCluster(Cluster):
    """The router's YAML carries the TLS keys; /health is waited for over https."""

    def __init__(self, args, pki, tls, api_key=""):
        self.pki = pki
        self.client = "client" if "tls_client_ca" in tls else None  # what /health presents
        super().__init__(args, args.synth, api_key=api_key, router_extra=tls)
        self.url = f"https://127.0.0.1:{self.http_port}"

    def __enter__(self):
        self.start_decode(0)
        self.start_router()
        end = time.time() + 180
        while time.time() < end:
            if self.router.poll() is not None:
                raise RuntimeError("router exited: " + self.log())
            try:
                if https(self.http_port, ctx(self.pki, client=self.client), "GET", "/health",
                         timeout=5)[0] == 200:
                    return self
            except (ssl.SSLError, OSError, http.client.HTTPException):
                pass
            time.sleep(0.2)
        raise RuntimeError("/health never answered 200 over https: " + self.log())


def tls_keys(pki, client_ca=False):
    keys = {"tls_cert": pki["server"] + ".pem", "tls_key": pki["server"] + ".key"}
    if client_ca:
        keys["tls_client_ca"] = pki["ca"] + ".pem"
    return keys


def stream_chat(port, context, key):
    """The SSE body of a streamed chat completion."""
    c = http.client.HTTPSConnection("127.0.0.1", port, timeout=60, context=context)
    c.request("POST", "/v1/chat/completions", json.dumps({**CHAT, "stream": True}),
              {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    r = c.getresponse()
    body = r.read().decode()
    c.close()
    return r.status, r.getheader("Content-Type", ""), body


def case_tls(args, pki):
    cl = TlsCluster(args, pki, tls_keys(pki), api_key=KEY)
    with cl:
        port = cl.http_port
        check(wait_text(os.path.join(cl.dir, "router.log"),
                        f"listening on https://127.0.0.1:{port} (TLS)", 5),
              "tls: the start-up log says https and the address")
        st, body = https(port, ctx(pki), "POST", "/v1/chat/completions", CHAT, key=KEY)
        d = json.loads(body) if st == 200 else {}
        text = d.get("choices", [{}])[0].get("message", {}).get("content") if d else None
        check(st == 200 and d.get("object") == "chat.completion" and isinstance(text, str),
              f"tls: a chat completion over https (status {st}, {body[:120]!r})")
        st, ctype, sse = stream_chat(port, ctx(pki), KEY)
        check(st == 200 and ctype.startswith("text/event-stream") and
              sse.rstrip().endswith("data: [DONE]") and sse.count("data: ") >= 3,
              f"tls: a streamed chat completion over https (status {st}, {sse[-80:]!r})")
        st, _ = https(port, ctx(pki), "POST", "/v1/chat/completions", CHAT)
        check(st == 401, f"tls: no API key over https: 401 (got {st})")
        st, _ = https(port, ctx(pki), "POST", "/v1/chat/completions", CHAT, key="sk-wrong")
        check(st == 401, f"tls: a wrong API key over https: 401 (got {st})")
        r = bench(args, port, "--cacert", pki["ca"] + ".pem", "--api-key", KEY)
        res = json.loads(r.stdout) if r.returncode == 0 else {}
        check(res.get("requests") == 2 and res.get("errors") == 0,
              f"tls: tandem bench --api-key against the keyed router ({r.stdout[-200:]!r} "
              f"{r.stderr[-200:]!r})")
        r = bench(args, port, "--cacert", pki["ca"] + ".pem", env={"OPENAI_API_KEY": ""})
        res = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {}
        check(r.returncode != 0 or res.get("errors") == 2,
              f"tls: tandem bench without the key is refused (rc {r.returncode})")
        ok, why = refused(port, ctx(pki, ca="other"))
        check(ok and "CERTIFICATE_VERIFY_FAILED" in why,
              f"tls: a client trusting another CA refuses the router ({why})")
        # plain HTTP on the TLS port: whatever comes back is no HTTP response
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        got = b""
        try:
            while True:
                b = s.recv(4096)
                if not b:
                    break
                got += b
        except OSError:
            pass
        s.close()
        check(not got.startswith(b"HTTP/"), f"tls: plain HTTP on the TLS port gets no HTTP "
              f"answer ({got[:40]!r})")
        r = subprocess.run(["curl", "-sS", "--max-time", "60", "--cacert", pki["ca"] + ".pem",
                            f"https://127.0.0.1:{port}/v1/completions",
                            "-H", "Content-Type: application/json",
                            "-H", f"Authorization: Bearer {KEY}",
                            "-d", json.dumps({"prompt": "Once upon", "max_tokens": 4})],
                           capture_output=True, text=True, timeout=90)
        check(r.returncode == 0 and '"text_completion"' in r.stdout,
              f"tls: curl --cacert: a completion (rc {r.returncode}, {r.stdout[:80]!r} "
              f"{r.stderr[:120]!r})")
        r = subprocess.run(["curl", "-sS", "--max-time", "20", f"https://127.0.0.1:{port}/health"],
                           capture_output=True, text=True, timeout=60)
        check(r.returncode == 60, f"tls: curl without the CA fails verification (rc {r.returncode}"
              f", {r.stderr.strip()[:100]!r})")
        st, _ = https(port, ctx(pki), "GET", "/health")
        check(st == 200, f"tls: still serving after the refused clients ({st})")
        case_tls_openai(cl, pki)
        case_tls_leave(cl, pki)
        rc = cl.stop()
        check(rc == 0, f"tls: router exits 0 on SIGTERM (got {rc})")


def case_tls_openai(cl, pki):
    """The `openai` client over https with the API key: its HTTP client trusting the CA."""
    try:
        import openai
        try:
            import httpx2 as httpx  # what the pinned openai (scripts/setup.sh) is built on
        except ImportError:
            import httpx
    except ImportError as e:
        print(f"SKIP tls: the openai client ({e})")
        return
    client = openai.OpenAI(base_url=f"https://127.0.0.1:{cl.http_port}/v1", api_key=KEY,
                           max_retries=0, http_client=httpx.Client(verify=ctx(pki)))
    r = client.chat.completions.create(model="llama", **CHAT)
    text = "".join(ch.choices[0].delta.content or "" for ch in
                   client.chat.completions.create(model="llama", stream=True, **CHAT)
                   if ch.choices)
    check(r.choices[0].message.content == text,
          f"tls: the openai client over https, plain and streamed, same text ({text!r})")


def case_tls_leave(cl, pki):
    """A client that closes its TLS connection properly (close_notify, then FIN) while its
    request waits (the decode instance paused) is noticed by the loop's peek (499)."""
    port, log = cl.http_port, os.path.join(cl.dir, "router.log")
    body = json.dumps({**CHAT, "max_tokens": 4}).encode()
    os.kill(cl.decode[0].pid, signal.SIGSTOP)
    try:
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        s = ctx(pki).wrap_socket(raw, server_hostname="127.0.0.1")
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.5)
        s.setblocking(False)
        try:
            s.unwrap()  # sends close_notify; the router's answer is not waited for
        except (ssl.SSLWantReadError, OSError):
            pass
        s.close()  # then FIN
        seen = wait_text(log, " status 499 error client_closed ", 5)
    finally:
        os.kill(cl.decode[0].pid, signal.SIGCONT)
    check(seen, "tls: a client leaving with close_notify while its request waits is noticed "
          "(499 client_closed)")


def bench(args, port, *extra, env=None):
    return subprocess.run([args.tandem, "bench", "--url", f"https://127.0.0.1:{port}",
                           "--requests", "2", "--max-tokens", "4", "--prompt-tokens", "8",
                           "--timeout-ms", "60000", "--json", *extra],
                          capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, **(env or {})))


def case_mtls(args, pki):
    cl = TlsCluster(args, pki, tls_keys(pki, client_ca=True))
    with cl:
        port = cl.http_port
        check(wait_text(os.path.join(cl.dir, "router.log"), "clients need a certificate", 5),
              "mtls: the start-up log says client certificates are required")
        ok, why = refused(port, ctx(pki))
        check(ok, f"mtls: a client without a certificate gets no HTTP answer ({why})")
        ok, why = refused(port, ctx(pki, client="stranger"))
        check(ok, f"mtls: a certificate from another CA gets no HTTP answer ({why})")
        st, body = https(port, ctx(pki, client="client"), "POST", "/v1/chat/completions", CHAT)
        check(st == 200 and b"chat.completion" in body,
              f"mtls: a client certificate from the CA is served ({st}, {body[:80]!r})")
        st, _, sse = stream_chat(port, ctx(pki, client="client"), "")
        check(st == 200 and sse.rstrip().endswith("data: [DONE]"),
              f"mtls: a stream with a client certificate ({st}, {sse[-60:]!r})")
        curl = ["curl", "-sS", "--max-time", "30", "--cacert", pki["ca"] + ".pem"]
        url = f"https://127.0.0.1:{port}/health"
        r = subprocess.run(curl + [url], capture_output=True, text=True, timeout=60)
        check(r.returncode != 0 and '"status"' not in r.stdout,
              f"mtls: curl without --cert is refused (rc {r.returncode}, "
              f"{r.stderr.strip()[:100]!r})")
        cc = ["--cert", pki["client"] + ".pem", "--key", pki["client"] + ".key"]
        r = subprocess.run(curl + cc + [url], capture_output=True, text=True, timeout=60)
        check(r.returncode == 0 and '"status":"ok"' in r.stdout,
              f"mtls: curl --cert --key is served (rc {r.returncode}, {r.stdout[:80]!r})")
        # what `tandem up`'s probe does: no server check, the router's own pair as the client
        r = subprocess.run(["curl", "-sS", "-k", "--max-time", "30", "--cert",
                            pki["server"] + ".pem", "--key", pki["server"] + ".key", url],
                           capture_output=True, text=True, timeout=60)
        check(r.returncode == 0 and '"status":"ok"' in r.stdout,
              f"mtls: the router's own certificate as a client (tandem up's probe) is served "
              f"(rc {r.returncode}, {r.stderr.strip()[:100]!r})")
        r = bench(args, port, "--cacert", pki["ca"] + ".pem", *cc)
        res = json.loads(r.stdout) if r.returncode == 0 else {}
        check(r.returncode == 0 and res.get("completed", res.get("requests")) == 2,
              f"mtls: tandem bench https --cacert --cert --key (rc {r.returncode}, "
              f"{r.stdout[:200]!r} {r.stderr[-300:]!r})")
        r = bench(args, port, *cc, env={"CURL_CA_BUNDLE": pki["ca"] + ".pem"})
        check(r.returncode == 0, f"mtls: tandem bench with CURL_CA_BUNDLE (rc {r.returncode}, "
              f"{r.stderr[-200:]!r})")
        r = bench(args, port, "--cacert", pki["other"] + ".pem", *cc)
        check(r.returncode != 0 and "certificate" in r.stderr.lower(),
              f"mtls: tandem bench against the wrong CA fails (rc {r.returncode}, "
              f"{r.stderr[-200:]!r})")
        r = bench(args, port, "--cacert", pki["ca"] + ".pem")
        check(r.returncode != 0, f"mtls: tandem bench without a client certificate fails "
              f"(rc {r.returncode})")
        rc = cl.stop()
        check(rc == 0, f"mtls: router exits 0 on SIGTERM (got {rc})")


def case_up(args, pki, d):
    """`tandem up -d` of a TLS cluster with client certificates: its health probe gets in
    (the router's own certificate, issued by the client CA), the endpoint it prints is
    https; `tandem down` stops it."""
    port, dport = free_port(), free_port()
    cfg = write_yaml(os.path.join(d, "up.yaml"), {
        "model": args.synth, "run_dir": os.path.join(d, "run"),
        "router": {"listen": f"127.0.0.1:{port}", **tls_keys(pki, client_ca=True)},
        "decode": [{"name": "d0", "port": dport, "kv_blocks": 256, "step_tokens": 64}]})
    r = subprocess.run([args.tandem, "up", "-d", cfg, "--timeout", "120"], capture_output=True,
                       text=True, timeout=180)
    try:
        check(r.returncode == 0 and f"https://127.0.0.1:{port}" in r.stdout,
              f"up: tandem up -d of a TLS cluster is ready, endpoint https (rc {r.returncode}, "
              f"{(r.stdout + r.stderr)[-300:]!r})")
        if r.returncode == 0:
            st, body = https(port, ctx(pki, client="client"), "POST", "/v1/chat/completions",
                             CHAT)
            check(st == 200, f"up: a chat completion with a client certificate ({st})")
    finally:
        r = subprocess.run([args.tandem, "down", cfg], capture_output=True, text=True,
                           timeout=120)
    check(r.returncode == 0, f"up: tandem down (rc {r.returncode}, {r.stderr[-200:]!r})")


def case_config(args, pki, d):
    """Each bad TLS setting: the router exits 1 at start, its log naming the problem."""
    junk = os.path.join(d, "junk.pem")
    with open(junk, "w") as f:
        f.write("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    missing = os.path.join(d, "missing.key")
    srv = pki["server"]
    cases = [
        ("tls_cert alone", {"tls_cert": srv + ".pem"},
         "tls_cert is given but tls_key is missing"),
        ("an unreadable key", {"tls_cert": srv + ".pem", "tls_key": missing},
         f"cannot read router.tls_key '{missing}': No such file or directory"),
        ("a certificate that is not PEM", {"tls_cert": junk, "tls_key": srv + ".key"},
         f"router.tls_cert '{junk}' is not a PEM certificate chain"),
        ("a key that is not the certificate's",
         {"tls_cert": srv + ".pem", "tls_key": pki["client"] + ".key"},
         "does not go with router.tls_cert"),
        ("a client CA file without a certificate",
         {**tls_keys(pki), "tls_client_ca": srv + ".key"},
         "router.tls_client_ca '" + srv + ".key' holds no PEM certificate"),
    ]
    for i, (what, keys, want) in enumerate(cases):
        cfg = write_yaml(os.path.join(d, f"bad{i}.yaml"), {
            "model": args.synth,
            "router": {"listen": "127.0.0.1:1", **keys},
            "decode": [{"name": "d0", "port": 9}]})
        r = subprocess.run([args.router, "--config", cfg], capture_output=True, text=True,
                           timeout=60)
        out = r.stdout + r.stderr
        check(r.returncode == 1 and want in out,
              f"config: {what}: exit 1 naming it (rc {r.returncode}, {out.strip()[-240:]!r})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--router", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--synth", required=True)
    ap.add_argument("--case", default="all")
    args = ap.parse_args()
    if not os.access(OPENSSL, os.X_OK):
        print("SKIP: no openssl binary to make the test certificates (Debian package openssl; "
              "scripts/setup.sh installs it)")
        return 77
    t0 = time.time()
    d = tempfile.mkdtemp(prefix="tandem-tls-")
    pki = make_pki(d)
    cases = ["config", "tls", "mtls", "up"] if args.case == "all" else args.case.split(",")
    for c in cases:
        t = time.time()
        {"config": lambda: case_config(args, pki, d), "tls": lambda: case_tls(args, pki),
         "mtls": lambda: case_mtls(args, pki), "up": lambda: case_up(args, pki, d)}[c]()
        print(f"case {c}: {time.time() - t:.1f} s", flush=True)
    print(f"{len(FAILS)} failures, {time.time() - t0:.1f} s")
    if not FAILS:
        shutil.rmtree(d, ignore_errors=True)
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
