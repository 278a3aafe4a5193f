"""tdtest: what every Python test suite under tests/ shares to start and watch a Tandem cluster.

    checks    FAILS, check(): record a check, print it, go on; context(): a line under failures
    ports     can_bind(), free_port(): ports free on loopback right now (below the ephemeral range)
    procs     spawn() with a log file, stop() (SIGTERM, then SIGKILL past a deadline), Procs (a
              named set of them), alive()/proc_status(), leftovers() and kill_leftovers(), read()
    waits     wait_for() (a predicate with a deadline), wait_timed(), wait_text() (a log line),
              wait_http() (an HTTP status), wait_line() (a line on a pipe)
    cluster   yaml_text()/write_yaml() (cluster YAML from dicts), bin_dir() (TANDEM_BIN of
              symlinks), UpCluster (`tandem up -d` / down / status / pid files / logs / cleanup),
              client_health() (`tandem client --health`), parse_metrics(), generate_text()

Every test script finds the package with the same line at its top:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tdtest
Suite-specific helpers (load generators, fault injection, the suite's own cluster shape) stay in
the suite's directory and build on these.
"""
