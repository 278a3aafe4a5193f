"""ports.py: ports that are free on loopback right now, for the generated cluster configs.

The range stays below the kernel's ephemeral range (32768 up by default), so no outgoing
connection on a busy machine holds one of them between the choice and the bind (a prefill
stage 0 once failed to listen with 'Address in use' on a port in that range).

Nothing binds a chosen port until the cluster starts, so two calls of one process could pick
the same port, or neighbours (configs use port + k for later stages or ranks): chaos_supervise
once got its decode control port equal to the prefill instance's. Every port handed out here
therefore keeps the next picks of this process GAP ports away."""
import random
import socket

LOW, HIGH = 20000, 32700
GAP = 16  # ports around each pick that later picks of this process avoid
_given = []  # (first, last) port of each pick


def can_bind(port, host="127.0.0.1", reuse=False):
    """Whether port can be bound on host now; reuse: with SO_REUSEADDR, as the servers bind."""
    s = socket.socket()
    if reuse:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def free_port(n=1, also=(), reuse=False, low=LOW, high=HIGH):
    """A port p such that p .. p+n-1 and p+k for every k in also are free on loopback now.
    Raises RuntimeError if 1000 random picks all fail (the machine is out of ports)."""
    offsets = list(range(n)) + list(also)
    for _ in range(1000):
        p = random.randint(low, high - max(offsets))
        lo, hi = p + min(offsets), p + max(offsets)
        if any(lo - GAP <= b and a - GAP <= hi for a, b in _given):
            continue
        if all(can_bind(p + k, reuse=reuse) for k in offsets):
            _given.append((lo, hi))
            return p
    raise RuntimeError(f"no {offsets} block of free ports in {low}..{high}")
