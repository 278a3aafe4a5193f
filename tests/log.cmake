# The logger (common/td_err.c): line format (UTC timestamp with milliseconds, program name
# and pid), levels set in code and by TANDEM_LOG, whole lines from concurrent threads.
add_executable(test_log common/test_log.c)
target_include_directories(test_log PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(test_log PRIVATE td_common)
add_test(NAME log_format COMMAND test_log)
set_tests_properties(log_format PROPERTIES TIMEOUT 60)
foreach(level debug warn error)
  add_test(NAME log_env_${level} COMMAND test_log --env-level ${level})
  set_tests_properties(log_env_${level} PROPERTIES ENVIRONMENT TANDEM_LOG=${level} TIMEOUT 60)
endforeach()

# The clock and the statistics helpers (common/td_clock.c, common/td_stats.c).
add_executable(test_clock_stats common/test_clock_stats.c)
target_include_directories(test_clock_stats PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(test_clock_stats PRIVATE td_common)
add_test(NAME clock_stats COMMAND test_clock_stats)
set_tests_properties(clock_stats PROPERTIES TIMEOUT 60)

# Block ids for prefix caching (common/td_blockhash.c): chaining, order, pinned values.
add_executable(test_blockhash common/test_blockhash.c)
target_include_directories(test_blockhash PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(test_blockhash PRIVATE td_common)
add_test(NAME blockhash COMMAND test_blockhash)
set_tests_properties(blockhash PROPERTIES TIMEOUT 60)

# The server binaries' command-line parser (common/td_args.c).
add_executable(test_args common/test_args.c)
target_include_directories(test_args PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(test_args PRIVATE td_common)
add_test(NAME args COMMAND test_args)
set_tests_properties(args PROPERTIES TIMEOUT 60)

# Growable arrays (common/td_grow.c).
add_executable(test_grow common/test_grow.c)
target_include_directories(test_grow PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(test_grow PRIVATE td_common)
add_test(NAME grow COMMAND test_grow)
set_tests_properties(grow PROPERTIES TIMEOUT 60)
