# prefill.cmake: the prefill node's planning pieces (prefill-node/pf_chunk.h, pf_profile.h).
#   test_pf_chunk    partition, quadratic fit and chunk planner against hand-computed cases
#   test_pf_tune     robust profile fit, online refit, model-chosen initial chunk (pf_tune.h)
#   test_pf_kvcache  the stage cache's KV events replay to exactly its index (evictions,
#                    flush, ring wrap; pf_kvcache.h)
#   test_pf_chunking stage 0's chunking set-up and per-request initial chunk (pf_chunking.c)
#   test_pf_profile  stage profile + fit on the engine with the synthetic llama model
#                    (fixture synth_models, reference.cmake; needs TANDEM_PYTHON)
#   test_pf_pcache   the on-disk profile cache: key, round trip, corrupt files, store
#                    errors; the profile's stop flag (synthetic model)
#   prefill_profile_cache  tandem-prefill re-uses its cached profile, re-profiles on a key
#                    change, a corrupt file or --reprofile, and exits 0 within ~1 s on a
#                    SIGTERM while profiling (test_pf_cache.py)
#   prefill_startup_cached  `tandem up deploy/local.yaml` three times with an empty profile
#                    cache (profile_budget_ms 3000 to keep the first start short): the first
#                    measures, the others load the profile and complete a request, the
#                    fastest of them serving /health within 3 s (startup_time.py; needs
#                    TANDEM_MODEL)
if(TARGET pf_core)
  add_executable(test_pf_chunk ${CMAKE_CURRENT_SOURCE_DIR}/prefill/test_pf_chunk.c)
  target_include_directories(test_pf_chunk PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_link_libraries(test_pf_chunk PRIVATE pf_core td_common)
  add_test(NAME test_pf_chunk COMMAND test_pf_chunk)
  set_tests_properties(test_pf_chunk PROPERTIES TIMEOUT 30 LABELS prefill)

  # test_pf_kvcache, test_pf_chunking and test_pf_pcache are white-box tests: they see
  # prefill-node/'s own headers (pf_kvcache.h, pf_int.h, pf_pcache.h) on purpose; pf_core
  # exports only prefill-node/include/.
  add_executable(test_pf_kvcache ${CMAKE_CURRENT_SOURCE_DIR}/prefill/test_pf_kvcache.c)
  target_include_directories(test_pf_kvcache PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}
                                                     ${PROJECT_SOURCE_DIR}/prefill-node)
  target_link_libraries(test_pf_kvcache PRIVATE pf_core td_common)
  add_test(NAME test_pf_kvcache COMMAND test_pf_kvcache)
  set_tests_properties(test_pf_kvcache PROPERTIES TIMEOUT 30 LABELS prefill)

  add_executable(test_pf_tune ${CMAKE_CURRENT_SOURCE_DIR}/prefill/test_pf_tune.c)
  target_include_directories(test_pf_tune PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_link_libraries(test_pf_tune PRIVATE pf_core td_common)
  add_test(NAME test_pf_tune COMMAND test_pf_tune)
  set_tests_properties(test_pf_tune PROPERTIES TIMEOUT 30 LABELS prefill)

  add_executable(test_pf_chunking ${CMAKE_CURRENT_SOURCE_DIR}/prefill/test_pf_chunking.c
                                  ${PROJECT_SOURCE_DIR}/prefill-node/pf_chunking.c)
  target_include_directories(test_pf_chunking PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}
                                                      ${PROJECT_SOURCE_DIR}/prefill-node)
  target_link_libraries(test_pf_chunking PRIVATE pf_core td_grammar td_kvxfer td_ctrl td_config
                                                 td_common)
  add_test(NAME test_pf_chunking COMMAND test_pf_chunking)
  set_tests_properties(test_pf_chunking PROPERTIES TIMEOUT 30 LABELS prefill)

  add_executable(test_pf_profile ${CMAKE_CURRENT_SOURCE_DIR}/prefill/test_pf_profile.c)
  target_include_directories(test_pf_profile PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_link_libraries(test_pf_profile PRIVATE pf_core td_kernels td_common)
  if(TANDEM_PYTHON)
    add_test(NAME test_pf_profile COMMAND test_pf_profile ${TANDEM_TEST_DATA}/synth/llama.gguf)
    set_tests_properties(test_pf_profile PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 60
                         LABELS prefill)
  endif()

  add_executable(test_pf_pcache ${CMAKE_CURRENT_SOURCE_DIR}/prefill/test_pf_pcache.c)
  target_include_directories(test_pf_pcache PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}
                                                    ${PROJECT_SOURCE_DIR}/prefill-node)
  target_link_libraries(test_pf_pcache PRIVATE pf_core td_kernels td_common Threads::Threads)
  if(TANDEM_PYTHON)
    add_test(NAME test_pf_pcache COMMAND test_pf_pcache ${TANDEM_TEST_DATA}/synth/llama.gguf)
    set_tests_properties(test_pf_pcache PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 120
                         LABELS prefill)
  endif()
endif()

# pf_sink: a stand-in decode instance for the tandem-prefill tests (tests/prefill/pf_sink.c)
if(TARGET tandem-prefill)
  add_executable(pf_sink ${CMAKE_CURRENT_SOURCE_DIR}/prefill/pf_sink.c)
  target_link_libraries(pf_sink PRIVATE pf_core td_kvxfer td_ctrl td_kernels td_common)
endif()
if(TARGET tandem-prefill AND TANDEM_PYTHON)
  add_test(NAME prefill_node
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/prefill/test_pf_node.py
                   --prefill $<TARGET_FILE:tandem-prefill> --sink $<TARGET_FILE:pf_sink>
                   --tandem $<TARGET_FILE:tandem> --synth-dir ${TANDEM_TEST_DATA}/synth
                   --model "${TANDEM_MODEL}")
  set_tests_properties(prefill_node PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 600
                       LABELS prefill)
  add_test(NAME prefill_profile_cache
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/prefill/test_pf_cache.py
                   --prefill $<TARGET_FILE:tandem-prefill> --synth-dir ${TANDEM_TEST_DATA}/synth
                   --model "${TANDEM_MODEL}")
  set_tests_properties(prefill_profile_cache PROPERTIES FIXTURES_REQUIRED synth_models
                       TIMEOUT 300 LABELS prefill)
endif()
if(TARGET tandem-prefill AND TARGET tandem-decode AND TARGET tandem-router AND TANDEM_PYTHON
   AND TANDEM_MODEL)
  add_test(NAME prefill_startup_cached
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/prefill/startup_time.py
                   --tandem $<TARGET_FILE:tandem> --config ${CMAKE_SOURCE_DIR}/deploy/local.yaml
                   --model "${TANDEM_MODEL}" --runs 3 --fresh-cache --budget-ms 3000
                   --max-cached-s 3)
  set_tests_properties(prefill_startup_cached PROPERTIES TIMEOUT 600 LABELS prefill)
endif()
