# kvxfer tests: every layer on the in-process fake transport, then real processes over UCX.
foreach(t test_kvx_pipe test_kvx_lookup test_kvx_conn)
  add_executable(${t} ${CMAKE_CURRENT_SOURCE_DIR}/kvxfer/${t}.c)
  # white-box tests: they see kvxfer/'s own headers (kvx_lookup.h) on purpose
  target_include_directories(${t} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}
                                          ${PROJECT_SOURCE_DIR}/kvxfer)
  target_link_libraries(${t} PRIVATE td_kvxfer td_common)
  add_test(NAME ${t} COMMAND ${t})
  set_tests_properties(${t} PROPERTIES TIMEOUT 60 LABELS kvxfer)
endforeach()

# Two real processes over UCX on loopback: this process is one side, kvx_test_peer the
# other; once over tcp and once over shared memory (UCX_TLS=posix,cma,self: liveness by
# pidfd, see kvxfer/README.md).
add_executable(kvx_test_peer ${CMAKE_CURRENT_SOURCE_DIR}/kvxfer/kvx_test_peer.c)
target_include_directories(kvx_test_peer PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/kvxfer)
target_link_libraries(kvx_test_peer PRIVATE td_kvxfer td_common)
add_executable(test_kvx_2proc ${CMAKE_CURRENT_SOURCE_DIR}/kvxfer/test_kvx_2proc.c)
target_include_directories(test_kvx_2proc PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}
                                                 ${PROJECT_SOURCE_DIR}/kvxfer) # kvx_wire.h
target_link_libraries(test_kvx_2proc PRIVATE td_kvxfer td_common)
add_dependencies(test_kvx_2proc kvx_test_peer)
# kvx_2proc_sm_memfd: the decode regions are memfds (KVX_TEST_REGION=memfd, as the decode
# node's pools are), so the shared-memory writer maps them and copies; kvx_2proc_sm has
# private regions, written with process_vm_writev (kvx_pipe_ucx_cma.c).
foreach(tls tcp sm sm_memfd)
  set(ucx_tls ${tls})
  if(tls MATCHES "^sm")
    set(ucx_tls "posix,cma,self")
  endif()
  add_test(NAME kvx_2proc_${tls}
           COMMAND test_kvx_2proc --tls ${ucx_tls} --peer $<TARGET_FILE:kvx_test_peer>)
  set_tests_properties(kvx_2proc_${tls} PROPERTIES TIMEOUT 150 LABELS kvxfer)
endforeach()
set_tests_properties(kvx_2proc_sm_memfd PROPERTIES ENVIRONMENT "KVX_TEST_REGION=memfd")
