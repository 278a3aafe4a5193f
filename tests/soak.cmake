# Soak tests (tests/soak/test_soak.py): `tandem up -d` on the synthetic model, then
# TANDEM_SOAK_SECONDS (default 30) of steady load at TANDEM_SOAK_CONCURRENCY (default 16)
# streams: completions and chat, streamed or not, prompts of 1..400 tokens, max_tokens 1..64,
# ~10% cancelled by the client mid-stream, ~2% invalid (expected 4xx). Checks: zero
# unexpected outcomes, nothing held on any instance at the end (KV blocks, requests: router
# /metrics and `tandem client --health`), VmRSS growth after warm-up < 20 MiB per process,
# every process alive, `tandem down` leaves nothing behind.
#   soak            the disaggregated default shape (deploy/local.yaml): router + prefill p0
#                   (pp 2) + decode d0 (tp 1); summary in soak.json of this build directory
#   soak_colocated  router + decode d0 (tp 1) + d1 (tp 2) prefilling their own prompts;
#                   summary in soak-colocated.json
# The manual long mode on the default model is described at the top of test_soak.py.
if(TANDEM_PYTHON)
  set(TANDEM_SOAK_ARGS "")
  if(TANDEM_SANITIZE)
    set(TANDEM_SOAK_ARGS --asan)
  endif()
  # the load time is read when the test runs; the timeout covers it if it is set at configure
  set(TANDEM_SOAK_TIMEOUT 900)
  if(DEFINED ENV{TANDEM_SOAK_SECONDS} AND "$ENV{TANDEM_SOAK_SECONDS}" MATCHES "^[0-9]+$")
    math(EXPR TANDEM_SOAK_TIMEOUT "$ENV{TANDEM_SOAK_SECONDS} * 2 + 900")
  endif()
  set(TANDEM_SOAK_COMMON --tandem $<TARGET_FILE:tandem> --decode $<TARGET_FILE:tandem-decode>
                         --router $<TARGET_FILE:tandem-router>
                         --synth ${TANDEM_TEST_DATA}/synth/llama.gguf ${TANDEM_SOAK_ARGS})
  add_test(NAME soak_colocated
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/soak/test_soak.py
                   ${TANDEM_SOAK_COMMON} --shape colocated
                   --json ${CMAKE_CURRENT_BINARY_DIR}/soak-colocated.json)
  add_test(NAME soak
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/soak/test_soak.py
                   ${TANDEM_SOAK_COMMON} --shape disagg --prefill $<TARGET_FILE:tandem-prefill>
                   --json ${CMAKE_CURRENT_BINARY_DIR}/soak.json)
  set_tests_properties(soak_colocated soak PROPERTIES FIXTURES_REQUIRED synth_models
                       TIMEOUT ${TANDEM_SOAK_TIMEOUT} ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
endif()
