"""waits.py: waiting with a deadline: for a predicate, a line in a log file, an HTTP status,
a line on a child's stdout. Every wait polls; none blocks past its timeout by more than a
step (or, for the HTTP probe, its own request timeout)."""
import http.client
import os
import re
import selectors
import subprocess
import time
import urllib.error
import urllib.request

from .procs import read


def wait_for(pred, timeout, step=0.05, last_look=True):
    """True as soon as pred() is; past the timeout, pred()'s answer once more (last_look)
    or False."""
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(step)
    return pred() if last_look else False


def wait_timed(pred, timeout, step=0.2):
    """(ok, seconds waited): polls pred() (an OSError, ValueError, HTTPException or
    subprocess timeout counts as not yet) until it is true or timeout seconds have passed."""
    t0 = time.time()
    while True:
        try:
            if pred():
                return True, time.time() - t0
        except (OSError, ValueError, http.client.HTTPException, subprocess.TimeoutExpired):
            pass
        if time.time() - t0 > timeout:
            return False, time.time() - t0
        time.sleep(step)


def wait_text(path, needle, timeout, step=0.05, regex=False, procs=()):
    """Whether the file at path comes to contain needle (regex: re.search) within timeout;
    False early once any of procs has exited."""
    end = time.time() + timeout
    while time.time() < end:
        text = read(path)
        if (re.search(needle, text) if regex else needle in text):
            return True
        if any(p.poll() is not None for p in procs):
            return False
        time.sleep(step)
    return False


def http_status(url, timeout=5):
    """The HTTP status of GET url; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def get_status(port, path, timeout=10, host="127.0.0.1"):
    """(status, body) of GET path on host:port; (None, b'') when the connection fails."""
    try:
        c = http.client.HTTPConnection(host, port, timeout=timeout)
        c.request("GET", path)
        r = c.getresponse()
        body = r.read()
        c.close()
        return r.status, body
    except OSError:
        return None, b""


def wait_http(port, want=200, timeout=120, path="/health", proc=None, step=0.1):
    """True once GET path on 127.0.0.1:port answers want; False past the timeout; None as
    soon as proc (the server, if given) has exited."""
    end = time.time() + timeout
    while time.time() < end:
        if get_status(port, path)[0] == want:
            return True
        if proc is not None and proc.poll() is not None:
            return None
        time.sleep(step)
    return False


def wait_line(proc, needle, timeout):
    """Reads proc.stdout (a pipe) until a line containing needle, EOF, proc's exit or the
    timeout; returns the text read."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf = ""
    end = time.time() + timeout
    while time.time() < end and needle not in buf:
        if not sel.select(timeout=0.5):
            if proc.poll() is not None:
                break
            continue
        chunk = os.read(proc.stdout.fileno(), 4096).decode(errors="replace")
        if not chunk:
            break
        buf += chunk
    sel.close()
    return buf
