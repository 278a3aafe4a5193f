# ctrl.cmake: tests of the control plane (common/ctrl*.c, proto/tandem_ctrl.proto).
#   ctrl   codec round trips of every message, rejections (malformed, truncated,
#          oversized, wrong version, limits), and a fake node serving clients over ipc://
#          and tcp:// on loopback: submit/events/cancel, deadlines, bad input, bursts,
#          absent server, reconnects, gone clients.
# The libFuzzer target tests/ctrl/fuzz_ctrl.c is built by scripts/test.sh (clang).
add_executable(test_ctrl ctrl/test_ctrl.c)
target_link_libraries(test_ctrl PRIVATE td_ctrl td_common)
target_include_directories(test_ctrl PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
add_test(NAME ctrl COMMAND test_ctrl)
set_tests_properties(ctrl PROPERTIES TIMEOUT 60)
