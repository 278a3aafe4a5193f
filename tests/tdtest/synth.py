"""synth.py: synthetic models a test makes for itself (tests/ref/make_synth.py)."""
import atexit
import os
import shutil
import subprocess
import sys
import tempfile

_MAKE_SYNTH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ref", "make_synth.py")


def long_context_llama(n_ctx=4096):
    """The suite's synthetic llama shape with a context of n_ctx instead of 512, in a
    temporary directory removed at exit. A request that a test kills mid-way must still be
    running when the signal lands: one that runs to a 512-token context ends within a
    fraction of a second on a quiet machine, between the check that it runs and the kill
    (test_rejoin.py's flake, seen by CI's retry)."""
    d = tempfile.mkdtemp(prefix="tandem-synth-")
    atexit.register(shutil.rmtree, d, True)
    out = os.path.join(d, f"llama-ctx{n_ctx}.gguf")
    subprocess.run([sys.executable, _MAKE_SYNTH, "--out", out, "--arch", "llama",
                    "--n-ctx", str(n_ctx)], check=True, capture_output=True)
    return out
