# Decode node tests.

# ---- dc_shm: the shared-memory collective (threads and forked processes as ranks).
#   bin/test_shm            all tests (ctest)
#   bin/test_shm --bench    allreduce latency, tp 2, n = 576 and 576 * 64 (not in ctest)
add_executable(test_shm ${CMAKE_CURRENT_SOURCE_DIR}/decode/test_shm.c)
target_link_libraries(test_shm PRIVATE dc_shm td_common m)
add_test(NAME test_shm COMMAND test_shm)
set_tests_properties(test_shm PROPERTIES TIMEOUT 120)
# ---- end dc_shm

# ---- dc_core: scheduler + plan on a real engine (synthetic model).
add_executable(test_sched ${CMAKE_CURRENT_SOURCE_DIR}/decode/test_sched.c)
target_link_libraries(test_sched PRIVATE dc_core td_kernels td_common)
if(TANDEM_PYTHON)
  add_test(NAME decode_sched COMMAND test_sched ${TANDEM_TEST_DATA}/synth/llama.gguf)
  set_tests_properties(decode_sched PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 300)
endif()

# ---- tandem-decode end to end: real rank processes, control plane over loopback TCP.
if(TANDEM_PYTHON)
  add_test(NAME decode_node
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/decode/test_decode_node.py
                   --decode $<TARGET_FILE:tandem-decode> --tandem $<TARGET_FILE:tandem>
                   --synth-dir ${TANDEM_TEST_DATA}/synth --model "${TANDEM_MODEL}")
  set_tests_properties(decode_node PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 1200)
endif()
