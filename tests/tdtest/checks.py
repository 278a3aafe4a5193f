"""checks.py: the failure recorder every test uses: a check prints one line and the test goes on;
the script's exit status is 1 when FAILS is not empty."""

FAILS = []  # what failed, in order, for the test's exit status and its summary
_CONTEXT = [None]  # a line printed under every failure (where the logs are), or None


def check(cond, what):
    """Records one check: prints 'ok   what' or 'FAIL what'; returns cond."""
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        FAILS.append(what)
        if _CONTEXT[0]:
            print(f"     {_CONTEXT[0]}", flush=True)
    return cond


def context(line):
    """Sets the line printed under every later failure (None: none)."""
    _CONTEXT[0] = line


def summary():
    """Prints the failures (if any) as one block; returns the exit status (1 if any failed)."""
    if FAILS:
        print(f"{len(FAILS)} FAILED:\n  " + "\n  ".join(FAILS))
    return 1 if FAILS else 0
