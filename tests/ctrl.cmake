# ctrl.cmake: tests of the control plane (common/ctrl*.c, proto/tandem_ctrl.proto).
#   ctrl   codec round trips of every message, rejections (malformed, truncated,
#          oversized, wrong version, limits), and a fake node serving clients over ipc://
#          and tcp:// on loopback: submit/events/cancel, deadlines, bad input, bursts,
#          absent server, reconnects to a restarted server (a child process: test_ctrl
#          --node URL), gone clients; server and client closing at the same
#          moment, over and over for TANDEM_CTRL_CLOSE_LOOP_MS (3000): every destroy returns
#          within its bound (NNG 1.5.2's nng_close can hang then).
#   ctrl_teardown  td_ctrl_teardown_bounded: waits for a teardown that returns, gives up
#          on one that hangs after 1 s, on later ones after 0.1 s.
# The libFuzzer target tests/ctrl/fuzz_ctrl.c is built by scripts/test.sh (clang).
add_executable(test_ctrl ctrl/test_ctrl.c)
target_link_libraries(test_ctrl PRIVATE td_ctrl td_common)
target_include_directories(test_ctrl PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
add_test(NAME ctrl COMMAND test_ctrl)
add_test(NAME ctrl_teardown COMMAND test_ctrl --teardown)
set_tests_properties(ctrl ctrl_teardown PROPERTIES TIMEOUT 60)
# ctrl_tls  mutual TLS (td_ctrl_opts.security, the YAML's security section) on loopback with
#           certificates made by openssl at test time (ctrl/make_certs.sh): served with the
#           cluster's certificate; refused (no reply, counted and logged by the server) for a
#           plain client, no certificate, another CA's, a self-signed one, a client that does
#           not trust the server; ipc:// stays plain; bad files fail create. Skipped (77)
#           without openssl.
add_executable(test_ctrl_tls ctrl/test_ctrl_tls.c)
target_link_libraries(test_ctrl_tls PRIVATE td_ctrl td_common Threads::Threads)
target_include_directories(test_ctrl_tls PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
add_test(NAME ctrl_tls COMMAND test_ctrl_tls ${CMAKE_CURRENT_SOURCE_DIR}/ctrl/make_certs.sh)
set_tests_properties(ctrl_tls PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77)
