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

# common/'s helpers, one test program each (TIMEOUT 60):
#   clock_stats  the clock and the statistics helpers (td_clock.c, td_stats.c)
#   blockhash    block ids for prefix caching (td_blockhash.c): chaining, order, pinned values
#   args         the server binaries' command-line parser (td_args.c)
#   grow         growable arrays (td_grow.c)
#   coreshare    cores shared by time between decode steps and prefill stages (td_coreshare.c),
#                a forked process as the other side
#   linsolve     the dense solver of the cost models' fits (td_linsolve.c): known systems,
#                singular and badly conditioned ones refused
foreach(t clock_stats blockhash args grow coreshare linsolve)
  add_executable(test_${t} common/test_${t}.c)
  target_include_directories(test_${t} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_link_libraries(test_${t} PRIVATE td_common)
  add_test(NAME ${t} COMMAND test_${t})
  set_tests_properties(${t} PROPERTIES TIMEOUT 60)
endforeach()
