# Soak test (tests/soak/test_soak.py): `tandem up -d` of router + decode d0 (tp 1) + d1 (tp 2)
# on the synthetic model, then TANDEM_SOAK_SECONDS (default 30) of steady load at
# TANDEM_SOAK_CONCURRENCY (default 16) streams: completions and chat, streamed or not,
# prompts of 1..400 tokens, max_tokens 1..64, ~10% cancelled by the client mid-stream, ~2%
# invalid (expected 4xx). Checks: zero unexpected outcomes, KV blocks back to 0 on every
# instance (router /metrics and `tandem client --health`), VmRSS growth after warm-up
# < 20 MiB per process, every process alive, `tandem down` leaves nothing behind.
# The summary also goes to soak.json in this build directory. The manual long mode on the
# default model is described at the top of test_soak.py.
if(TANDEM_PYTHON AND TARGET tandem AND TARGET tandem-decode AND TARGET tandem-router)
  set(TANDEM_SOAK_ARGS "")
  if(TANDEM_SANITIZE)
    set(TANDEM_SOAK_ARGS --asan)
  endif()
  # the load time is read when the test runs; the timeout covers it if it is set at configure
  set(TANDEM_SOAK_TIMEOUT 900)
  if(DEFINED ENV{TANDEM_SOAK_SECONDS} AND "$ENV{TANDEM_SOAK_SECONDS}" MATCHES "^[0-9]+$")
    math(EXPR TANDEM_SOAK_TIMEOUT "$ENV{TANDEM_SOAK_SECONDS} * 2 + 900")
  endif()
  add_test(NAME soak
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/soak/test_soak.py
                   --tandem $<TARGET_FILE:tandem> --decode $<TARGET_FILE:tandem-decode>
                   --router $<TARGET_FILE:tandem-router>
                   --synth ${TANDEM_TEST_DATA}/synth/llama.gguf
                   --json ${CMAKE_CURRENT_BINARY_DIR}/soak.json ${TANDEM_SOAK_ARGS})
  set_tests_properties(soak PROPERTIES FIXTURES_REQUIRED synth_models
                       TIMEOUT ${TANDEM_SOAK_TIMEOUT} ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
endif()
