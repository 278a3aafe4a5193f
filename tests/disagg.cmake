# disagg.cmake: disaggregated serving end to end (tests/disagg/test_disagg.py): router,
# prefill stages and decode ranks as real processes, checked through the HTTP API.
#   disagg          every case but disagg_default's: the synthetic model's, the faults (retry,
#                   a decode instance that dies, a stalled stage) and grammar (the stages'
#                   matchers, two samples), on the default model where a prefill must last
#   disagg_default  the default model's outputs against `tandem generate` (pp 2 x tp 1/3, one
#                   prefill instance for tp 1 + tp 3), its logprobs against colocated, ten
#                   grammar samples; CI runs it in Release (tests/CMakeLists.txt:
#                   TANDEM_CI_RELEASE_TESTS): the same paths as disagg's, the time in the
#                   default model's forward passes
if(TANDEM_PYTHON)
  set(DISAGG_CMD ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/disagg/test_disagg.py
                 --router $<TARGET_FILE:tandem-router> --prefill $<TARGET_FILE:tandem-prefill>
                 --decode $<TARGET_FILE:tandem-decode> --tandem $<TARGET_FILE:tandem>
                 --synth-dir ${TANDEM_TEST_DATA}/synth)
  if(TANDEM_MODEL)
    list(APPEND DISAGG_CMD --model ${TANDEM_MODEL})
  endif()
  set(DISAGG_DEFAULT_CASES default,logprobs_default,grammar_many)
  add_test(NAME disagg COMMAND ${DISAGG_CMD} --skip ${DISAGG_DEFAULT_CASES})
  if(TANDEM_MODEL)
    add_test(NAME disagg_default COMMAND ${DISAGG_CMD} --case ${DISAGG_DEFAULT_CASES})
  endif()
  foreach(t disagg disagg_default)
    if(TEST ${t})
      set_tests_properties(${t} PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 1500
                           LABELS disagg)
    endif()
  endforeach()
  # the prefill stages' prefix cache (tests/disagg/test_prefix_cache.py): hits exact against a
  # cold run at pp 1/2/3 x tp 1/2, eviction, a stage restart, aborts while cached blocks move;
  # the decode side's: turn 2 pushes only what the decode instance lacks, a decode restart
  add_test(NAME disagg_prefix_cache
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/disagg/test_prefix_cache.py
                   --router $<TARGET_FILE:tandem-router> --prefill $<TARGET_FILE:tandem-prefill>
                   --decode $<TARGET_FILE:tandem-decode> --tandem $<TARGET_FILE:tandem>
                   --synth-dir ${TANDEM_TEST_DATA}/synth)
  if(TANDEM_MODEL)
    list(APPEND DISAGG_CMD --model ${TANDEM_MODEL})
  endif()
  set_tests_properties(disagg_prefix_cache PROPERTIES FIXTURES_REQUIRED synth_models
                       TIMEOUT 1200 LABELS disagg)
  # the decode prefix cache's second tier searched at Alloc (tests/disagg/test_prefix_tier_pd.py):
  # turn 2 of a conversation the pool lost is held from the tier, pushed only in part, exact
  add_test(NAME disagg_prefix_tier
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/disagg/test_prefix_tier_pd.py
                   --router $<TARGET_FILE:tandem-router> --prefill $<TARGET_FILE:tandem-prefill>
                   --decode $<TARGET_FILE:tandem-decode> --tandem $<TARGET_FILE:tandem>
                   --synth-dir ${TANDEM_TEST_DATA}/synth)
  set_tests_properties(disagg_prefix_tier PROPERTIES FIXTURES_REQUIRED synth_models
                       TIMEOUT 600 LABELS disagg)
endif()
if(TANDEM_PYTHON)
  # the device paths on cpu-dev (tests/disagg/test_devstage.py): colocated tp 2 and prefill
  # pp 2 + decode tp 2 through `tandem up`, answers equal to backend cpu's
  add_test(NAME disagg_devstage
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/disagg/test_devstage.py
                   --tandem $<TARGET_FILE:tandem> --model ${TANDEM_TEST_DATA}/synth/qwen2.gguf)
  set_tests_properties(disagg_devstage PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 300
                       LABELS disagg)
endif()
