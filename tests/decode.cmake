# Decode node tests.

# ---- dc_shm: the shared-memory collective (threads and forked processes as ranks).
#   bin/test_shm            all tests (ctest)
#   bin/test_shm --bench    allreduce latency, tp 2, n = 576 and 576 * 64 (not in ctest)
add_executable(test_shm ${CMAKE_CURRENT_SOURCE_DIR}/decode/test_shm.c)
target_link_libraries(test_shm PRIVATE dc_shm td_common m)
add_test(NAME test_shm COMMAND test_shm)
set_tests_properties(test_shm PROPERTIES TIMEOUT 120)
# the data-parallel attention group's collectives (dc_shm_dp_*), members as threads
add_executable(test_shm_dp ${CMAKE_CURRENT_SOURCE_DIR}/decode/test_shm_dp.c)
target_link_libraries(test_shm_dp PRIVATE dc_shm td_common)
add_test(NAME test_shm_dp COMMAND test_shm_dp)
set_tests_properties(test_shm_dp PROPERTIES TIMEOUT 60)
# ---- end dc_shm

# ---- dc_core: scheduler + plan on a real engine (synthetic model).
add_executable(test_sched ${CMAKE_CURRENT_SOURCE_DIR}/decode/test_sched.c)
# test_sched, test_draft and test_kv_shm are white-box tests: they see decode-node/'s own
# headers (dc_sched.h, dc_plan.h, dc_draft.h, dc_xfer.h) on purpose; the libraries export
# only decode-node/include/.
target_include_directories(test_sched PRIVATE ${PROJECT_SOURCE_DIR}/decode-node)
target_link_libraries(test_sched PRIVATE dc_core td_kernels td_common)
if(TANDEM_PYTHON)
  add_test(NAME decode_sched COMMAND test_sched ${TANDEM_TEST_DATA}/synth/llama.gguf)
  set_tests_properties(decode_sched PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 300)
endif()

# ---- dc_draft: a draft model as the scheduler's proposer (synthetic models: llama.gguf the
# ---- target and its own draft, qwen2.gguf a draft of the same vocabulary).
add_executable(test_draft ${CMAKE_CURRENT_SOURCE_DIR}/decode/test_draft.c)
target_include_directories(test_draft PRIVATE ${PROJECT_SOURCE_DIR}/decode-node)
target_link_libraries(test_draft PRIVATE dc_draft dc_core td_kernels td_common)
if(TANDEM_PYTHON)
  add_test(NAME decode_draft COMMAND test_draft ${TANDEM_TEST_DATA}/synth)
  set_tests_properties(decode_draft PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 300)
endif()

# ---- tandem-decode end to end: real rank processes, control plane over loopback TCP.
#   decode_node          the synthetic models' cases (tp 2/4, concurrent, pool pressure,
#                        cancel/garbage/idle) and kill rank (on the default model when there
#                        is one: the synthetic model's requests end too fast to be killed)
#   decode_node_default  the default model's own cases (tp 1/3 against `tandem generate`,
#                        concurrent and pool pressure with 400-token prompts); CI runs it in
#                        Release (tests/CMakeLists.txt: TANDEM_CI_RELEASE_TESTS)
if(TANDEM_PYTHON)
  set(decode_node_model "")
  if(TANDEM_MODEL)
    set(decode_node_model --model ${TANDEM_MODEL} --model-cases kill)
  endif()
  add_test(NAME decode_node
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/decode/test_decode_node.py
                   --decode $<TARGET_FILE:tandem-decode> --tandem $<TARGET_FILE:tandem>
                   --synth-dir ${TANDEM_TEST_DATA}/synth ${decode_node_model})
  set_tests_properties(decode_node PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 600)
endif()
if(TANDEM_PYTHON AND TANDEM_MODEL)
  add_test(NAME decode_node_default
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/decode/test_decode_node.py
                   --decode $<TARGET_FILE:tandem-decode> --tandem $<TARGET_FILE:tandem>
                   --synth-dir ${TANDEM_TEST_DATA}/synth --model "${TANDEM_MODEL}"
                   --model-cases only)
  set_tests_properties(decode_node_default PROPERTIES FIXTURES_REQUIRED synth_models
                       TIMEOUT 1200)
endif()

# ---- decode[].overlap: the same tokens as the sequential path (two colocated clusters).
if(TANDEM_PYTHON AND TANDEM_MODEL)
  add_test(NAME decode_overlap
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/decode/test_overlap.py
                   --tandem $<TARGET_FILE:tandem> --decode $<TARGET_FILE:tandem-decode>
                   --router $<TARGET_FILE:tandem-router> --model "${TANDEM_MODEL}")
  set_tests_properties(decode_overlap PROPERTIES TIMEOUT 300 LABELS decode)
endif()

# ---- KV pools in shared memory (the followers' pools in disaggregated mode) and the
# ---- segment names / stale sweep of dc_xfer.
add_executable(test_kv_shm ${CMAKE_CURRENT_SOURCE_DIR}/decode/test_kv_shm.c)
target_include_directories(test_kv_shm PRIVATE ${PROJECT_SOURCE_DIR}/decode-node)
target_link_libraries(test_kv_shm PRIVATE dc_xfer td_kernels td_common rt)
add_test(NAME test_kv_shm COMMAND test_kv_shm)
set_tests_properties(test_kv_shm PROPERTIES TIMEOUT 60 LABELS decode)

# ---- disaggregated decode: tandem-decode receiving the prompt KV through kvxfer.
#   pd_client   the router's part: Alloc (or a colocated Submit), the targets, the stream
#   pd_writer   a stand-in prefill: the real engine prefills, kvxfer pushes the KV (UCX)
#   test_pd_decode.py --case C: tp1/tp3 default model, tp2 synthetic (2 stages), faults
add_executable(pd_client ${CMAKE_CURRENT_SOURCE_DIR}/decode/pd_client.c)
target_link_libraries(pd_client PRIVATE td_ctrl td_common)
add_executable(pd_writer ${CMAKE_CURRENT_SOURCE_DIR}/decode/pd_writer.c)
target_link_libraries(pd_writer PRIVATE td_kvxfer td_kernels td_common)
if(TANDEM_PYTHON)
  set(pd_cases synth_tp2 faults)
  if(TANDEM_MODEL)
    list(PREPEND pd_cases default_tp1 default_tp3)
  endif()
  foreach(case ${pd_cases})
    add_test(NAME decode_pd_${case}
             COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/decode/test_pd_decode.py
                     --case ${case} --decode $<TARGET_FILE:tandem-decode>
                     --tandem $<TARGET_FILE:tandem> --client $<TARGET_FILE:pd_client>
                     --writer $<TARGET_FILE:pd_writer> --synth-dir ${TANDEM_TEST_DATA}/synth
                     --model "${TANDEM_MODEL}")
    set_tests_properties(decode_pd_${case} PROPERTIES FIXTURES_REQUIRED synth_models
                         TIMEOUT 300 LABELS decode)
  endforeach()
endif()

# ---- restart and rejoin: a rank killed or stopped, restarted, the instance re-forms (the
# ---- others keep running); rejoin times are printed ("rejoin: ...").
#   test_rejoin.py --case C: synth_tp2 (colocated, follower and leader, SIGKILL and
#   SIGTERM), default_tp3 (default model), pd_tp2 (disaggregated: a transfer in flight)
if(TANDEM_PYTHON)
  set(rejoin_cases synth_tp2)
  if(TANDEM_MODEL)
    list(APPEND rejoin_cases default_tp3)
  endif()
  list(APPEND rejoin_cases pd_tp2)
  foreach(case ${rejoin_cases})
    add_test(NAME decode_rejoin_${case}
             COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/decode/test_rejoin.py
                     --case ${case} --decode $<TARGET_FILE:tandem-decode>
                     --tandem $<TARGET_FILE:tandem> --synth-dir ${TANDEM_TEST_DATA}/synth
                     --model "${TANDEM_MODEL}"
                     --client $<TARGET_FILE:pd_client> --writer $<TARGET_FILE:pd_writer>)
    set_tests_properties(decode_rejoin_${case} PROPERTIES FIXTURES_REQUIRED synth_models
                         TIMEOUT 180 LABELS decode)
  endforeach()
endif()
