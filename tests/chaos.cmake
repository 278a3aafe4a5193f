# Chaos suite (tests/chaos/test_chaos.py): faults injected into a disaggregated cluster (router
# + prefill p0 pp 2 + decode d0 on the synthetic model) under steady load, repaired by the
# supervisor of `tandem up` (docs/deploy.md). Each case prints a summary table (fault,
# requests ok / error, repair and recovery times) and writes chaos-CASE.json here.
#   chaos_supervise  tandem up restarts what dies (back-off, log appended, status, -d, down)
#   chaos_kill       kill -9 the router, prefill stage 1, prefill stage 0, a decode rank (tp 2),
#                    and clients dropping their streams; after each: every request ended in
#                    time with a success or a clear error, recovery time, no leak anywhere
#   chaos_stop       SIGSTOP prefill stage 1 past stage 0's 5 s heartbeat, then SIGCONT
#   chaos_netns      prefill and decode in two network namespaces, the link between them cut
#                    and restored (skipped, 77, when namespaces cannot be created)
#   chaos_migrate    (tests/chaos/test_migrate.py) pp 1 prefill + tp 1 decode: the only decode
#                    process killed mid-stream (restarted within a second): the stream goes on
#                    where it stopped and equals an uninterrupted greedy run (and a seeded one,
#                    and one with presence/frequency penalties; with logprobs, they equal
#                    the uninterrupted run's within 1e-3, f16 KV); "migrate": false
#                    ends with an SSE error at once; prefill stage 0 killed mid-prompt
#   chaos_migrate_colocated  the same with a colocated tp 1 decode instance (synthetic model,
#                    f32 KV: logprobs within 1e-4; chaos_migrate runs the default model when
#                    TANDEM_MODEL is set)
#   chaos_promise    (tests/chaos/test_promise.py) pp 2 prefill + tp 2 decode (synthetic model,
#                    4096-token context): prefill stage 1, stage 0, decode rank 1 and rank 0
#                    each killed mid-prefill of a cold 2000-token prompt, decode rank 1
#                    mid-stream: each request completes with the uninterrupted greedy text;
#                    with the supervisor stopped, 503 instance_unavailable only once
#                    router.migrate_wait_ms (8 s) ran out (~20 s; ~35 s under ASan)
# TANDEM_CHAOS_ROUNDS (default 1) repeats the faults of chaos_kill / chaos_stop on one
# cluster. RUN_SERIAL: the faults are timed (heartbeats, restarts), so nothing else runs.
if(TANDEM_PYTHON)
  set(TANDEM_CHAOS_ARGS "")
  if(TANDEM_SANITIZE)
    set(TANDEM_CHAOS_ARGS --asan)
  endif()
  set(TANDEM_CHAOS_CASES supervise kill stop netns)
  foreach(case ${TANDEM_CHAOS_CASES})
    set(chaos_case ${case})
    set(chaos_only "")
    if(case STREQUAL "kill")
      set(chaos_case faults)
      set(chaos_only --only "kill -9,drop clients")
    elseif(case STREQUAL "stop")
      set(chaos_case faults)
      set(chaos_only --only SIGSTOP)
    endif()
    add_test(NAME chaos_${case}
             COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/chaos/test_chaos.py
                     --case ${chaos_case} ${chaos_only} --tandem $<TARGET_FILE:tandem>
                     --decode $<TARGET_FILE:tandem-decode> --prefill $<TARGET_FILE:tandem-prefill>
                     --router $<TARGET_FILE:tandem-router> --synth-dir ${TANDEM_TEST_DATA}/synth
                     --source-dir ${CMAKE_SOURCE_DIR}
                     --json ${CMAKE_CURRENT_BINARY_DIR}/chaos-${case}.json
                     ${TANDEM_CHAOS_ARGS})
    set_tests_properties(chaos_${case} PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 600
                         SKIP_RETURN_CODE 77 RUN_SERIAL TRUE LABELS chaos
                         ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
  endforeach()
  foreach(shape disagg colocated)
    set(mig_name chaos_migrate)
    set(mig_args "")
    if(TANDEM_MODEL)
      set(mig_args --model ${TANDEM_MODEL}) # the real model: a prefill long enough to kill
    endif()
    if(shape STREQUAL "colocated")
      set(mig_name chaos_migrate_colocated)
      set(mig_args --colocated --kv-dtype f32)
    endif()
    add_test(NAME ${mig_name}
             COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/chaos/test_migrate.py
                     --tandem $<TARGET_FILE:tandem> --decode $<TARGET_FILE:tandem-decode>
                     --prefill $<TARGET_FILE:tandem-prefill> --router $<TARGET_FILE:tandem-router>
                     --synth-dir ${TANDEM_TEST_DATA}/synth
                     --json ${CMAKE_CURRENT_BINARY_DIR}/${mig_name}.json ${mig_args}
                     ${TANDEM_CHAOS_ARGS})
    set_tests_properties(${mig_name} PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 600
                         RUN_SERIAL TRUE LABELS chaos ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
  endforeach()
  add_test(NAME chaos_promise
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/chaos/test_promise.py
                   --tandem $<TARGET_FILE:tandem> --decode $<TARGET_FILE:tandem-decode>
                   --prefill $<TARGET_FILE:tandem-prefill> --router $<TARGET_FILE:tandem-router>
                   --synth-dir ${TANDEM_TEST_DATA}/synth
                   --json ${CMAKE_CURRENT_BINARY_DIR}/chaos_promise.json ${TANDEM_CHAOS_ARGS})
  set_tests_properties(chaos_promise PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 600
                       RUN_SERIAL TRUE LABELS chaos ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
endif()
