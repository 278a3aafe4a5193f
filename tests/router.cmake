# Router tests (router/). Every integration test starts its own decode instance(s) and
# router on random loopback ports and kills them when it ends.
#   test_rt_unit     stop-string hold-back, request table, fair queue, key comparison,
#                    rt_stream and the "timeout" field over a tokenizer
#   test_rt_unit_cache  cache-aware routing: prefix index (matches, LRU, removal), SGLang's
#                    choice (threshold, balance), routing over a registry, drop on restart
#   router_cache     cache-aware routing end to end, two decode instances (colocated): a
#                    conversation stays on one instance (spreads with load routing); a
#                    restarted instance is not preferred by stale knowledge
#   router_pfcache   cache-aware choice of the prefill instance from the prefill leaders' KV
#                    events: turn 2 follows turn 1, evictions and a restarted stage stop it
#   router_openai    the `openai` client: completions/chat, streaming, stops, seeds, greedy ==
#                    `tandem generate` (synthetic model; also the default model with TANDEM_MODEL)
#   router_http      raw HTTP: SSE bytes, keep-alive, 256 concurrent streams, the bad-request
#                    table, API key, bounded fuzz (TANDEM_HTTP_FUZZ_SECONDS, default 20)
#   router_faults    client disconnect frees KV blocks; decode instance killed and restarted
#   router_metrics   /metrics after real requests, colocated and disaggregated: the Prometheus
#                    text format, vLLM/SGLang names and counts, finish reasons, model_name,
#                    KV-transfer histograms, the scrape cost
#   router_limits    request deadlines (504), per-client fairness, header/body limits, no
#                    prompt or key in the log, drain on SIGTERM (decode paused by SIGSTOP)
#   router_tls       the TLS listener with certificates made by openssl at test time (skipped,
#                    77, without it): https + API key, streams, curl, plain HTTP and a wrong CA
#                    refused, a TLS client leaving while queued; client certificates
#                    (tls_client_ca) required; `tandem bench` over https; start-up errors
#   router_forced_calls  tool_choice "required" with each of the corpus' 70 templates
#                    (router.chat_template) on a synthetic 8K-context model: every template
#                    that reads tools (60) gives one parsed call; the others do not read tools
#                    or refuse the conversation themselves (needs the corpus)
#   test_rt_pair     disaggregated mode against scripted fake prefill/decode leaders (C):
#                    pairing, KV target relay, retries, cancels, busy, deadlines, dead
#                    instances, request timeouts, drain
add_executable(test_rt_unit ${CMAKE_CURRENT_SOURCE_DIR}/router/test_rt_unit.c)
target_include_directories(test_rt_unit PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(test_rt_unit PRIVATE rt_core)
add_test(NAME test_rt_unit COMMAND test_rt_unit)
set_tests_properties(test_rt_unit PROPERTIES TIMEOUT 60)
# cache-aware routing: the prefix index, SGLang's choice, routing over a registry
add_executable(test_rt_unit_cache ${CMAKE_CURRENT_SOURCE_DIR}/router/test_rt_unit_cache.c)
target_include_directories(test_rt_unit_cache PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(test_rt_unit_cache PRIVATE rt_core)
add_test(NAME test_rt_unit_cache COMMAND test_rt_unit_cache)
set_tests_properties(test_rt_unit_cache PROPERTIES TIMEOUT 60)

add_executable(test_rt_tools ${CMAKE_CURRENT_SOURCE_DIR}/router/test_rt_tools.c)
target_include_directories(test_rt_tools PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(test_rt_tools PRIVATE rt_core)
add_test(NAME test_rt_tools COMMAND test_rt_tools)
set_tests_properties(test_rt_tools PROPERTIES TIMEOUT 60)
# the other families' tool-call formats (router/rt_toolfmt.c), and their detection in the
# corpus' templates when TANDEM_CORPUS is set
add_executable(test_rt_toolfmt ${CMAKE_CURRENT_SOURCE_DIR}/router/test_rt_toolfmt.c)
target_include_directories(test_rt_toolfmt PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(test_rt_toolfmt PRIVATE rt_core)
if(TANDEM_CORPUS)
  add_test(NAME test_rt_toolfmt COMMAND test_rt_toolfmt --templates ${TANDEM_CORPUS}/templates)
else()
  add_test(NAME test_rt_toolfmt COMMAND test_rt_toolfmt)
endif()
set_tests_properties(test_rt_toolfmt PROPERTIES TIMEOUT 60)
add_executable(test_rt_reason ${CMAKE_CURRENT_SOURCE_DIR}/router/test_rt_reason.c)
target_include_directories(test_rt_reason PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(test_rt_reason PRIVATE rt_core)
add_test(NAME test_rt_reason COMMAND test_rt_reason)
add_executable(test_rt_chat ${CMAKE_CURRENT_SOURCE_DIR}/router/test_rt_chat.c)
target_link_libraries(test_rt_chat PRIVATE rt_core)
# The unit tests above are white-box tests: they see router/'s own headers on purpose (rt_core
# exports none).
foreach(t test_rt_unit test_rt_unit_cache test_rt_tools test_rt_toolfmt test_rt_reason
          test_rt_chat)
  target_include_directories(${t} PRIVATE ${PROJECT_SOURCE_DIR}/router)
endforeach()

if(TANDEM_PYTHON)
  # tools rendered byte-exact against the Qwen2.5 template under jinja2 (as transformers)
  add_test(NAME router_chat_tools
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/router/test_chat_tools.py
                   --bin $<TARGET_FILE:test_rt_chat>
                   --template ${CMAKE_CURRENT_SOURCE_DIR}/router/data/qwen2.5-chat-template.jinja
                   --gguf "${TANDEM_MODEL_QWEN05}" --smollm "${TANDEM_MODEL}")
  set_tests_properties(router_chat_tools PROPERTIES TIMEOUT 120)
  add_test(NAME test_rt_unit_tok COMMAND test_rt_unit ${TANDEM_TEST_DATA}/synth/llama.gguf)
  set_tests_properties(test_rt_unit_tok PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 60)

  add_executable(test_rt_pair ${CMAKE_CURRENT_SOURCE_DIR}/router/test_rt_pair.c)
  target_include_directories(test_rt_pair PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_link_libraries(test_rt_pair PRIVATE td_ctrl td_common Threads::Threads)
  add_test(NAME test_rt_pair COMMAND test_rt_pair $<TARGET_FILE:tandem-router>
                                     ${TANDEM_TEST_DATA}/synth/llama.gguf)
  set_tests_properties(test_rt_pair PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 120)

  set(RT_TEST_BINS --router $<TARGET_FILE:tandem-router> --decode $<TARGET_FILE:tandem-decode>
                   --tandem $<TARGET_FILE:tandem> --synth ${TANDEM_TEST_DATA}/synth/llama.gguf)
  # router_openai on the synthetic model; router_openai_default the same checks on the default
  # model (CI runs it in Release: tests/CMakeLists.txt, TANDEM_CI_RELEASE_TESTS)
  add_test(NAME router_openai
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/router/test_router_openai.py
                   ${RT_TEST_BINS})
  if(TANDEM_MODEL)
    add_test(NAME router_openai_default
             COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/router/test_router_openai.py
                     ${RT_TEST_BINS} --model "${TANDEM_MODEL}" --model-only)
    set_tests_properties(router_openai_default PROPERTIES FIXTURES_REQUIRED synth_models
                         TIMEOUT 600)
  endif()
  if(TANDEM_MODEL)
    add_test(NAME router_grammar
             COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/router/test_router_grammar.py
                     ${RT_TEST_BINS} --model "${TANDEM_MODEL}")
    set_tests_properties(router_grammar PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 600)
  endif()
  add_test(NAME router_http
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/router/test_router_http.py
                   ${RT_TEST_BINS})
  add_test(NAME router_faults
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/router/test_router_faults.py
                   ${RT_TEST_BINS})
  add_test(NAME router_limits
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/router/test_router_limits.py
                   ${RT_TEST_BINS})
  add_test(NAME router_tls
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/router/test_router_tls.py
                   ${RT_TEST_BINS})
  # tool_choice "required" through the router with every corpus template that reads tools: a
  # parsed call back from each (a synthetic 8K-context model it writes itself; ~25 s)
  if(TANDEM_CORPUS)
    add_test(NAME router_forced_calls
             COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/router/test_forced_calls.py
                     --router $<TARGET_FILE:tandem-router> --decode $<TARGET_FILE:tandem-decode>
                     --corpus ${TANDEM_CORPUS})
    set_tests_properties(router_forced_calls PROPERTIES TIMEOUT 600)
  endif()
  set_tests_properties(router_tls PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 300
                       SKIP_RETURN_CODE 77)
  add_test(NAME router_cache
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/router/test_router_cache.py
                   ${RT_TEST_BINS})
  add_test(NAME router_pfcache
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/router/test_router_pfcache.py
                   ${RT_TEST_BINS} --prefill $<TARGET_FILE:tandem-prefill>)
  add_test(NAME router_metrics
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/router/test_router_metrics.py
                   ${RT_TEST_BINS} --prefill $<TARGET_FILE:tandem-prefill>)
  set_tests_properties(router_openai router_http router_faults router_limits router_metrics
                       router_cache router_pfcache PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 600)
endif()

# router_tools: tool calling with the `openai` client on the real Qwen2.5-Coder 0.5B model
# (TANDEM_MODEL_QWEN05), colocated and disaggregated: a parsed call, streaming == not,
# tool_choice none, a history with the tool result. Release, 2 busy cores: 20 + 16 s.
if(TANDEM_PYTHON AND TANDEM_MODEL_QWEN05)
  add_test(NAME router_tools
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/router/test_router_tools.py
                   --router $<TARGET_FILE:tandem-router> --decode $<TARGET_FILE:tandem-decode>
                   --prefill $<TARGET_FILE:tandem-prefill> --tandem $<TARGET_FILE:tandem>
                   --model ${TANDEM_MODEL_QWEN05})
  set_tests_properties(router_tools PROPERTIES TIMEOUT 600 RUN_SERIAL TRUE LABELS models
                       ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
endif()

# router_prefix_cache: the decode node's prefix cache through the router (tests/router/
# test_prefix_cache.py): a conversation's 2nd turn with a cache hit == a cold cluster, n=4
# sharing, eviction under a small pool, cached_tokens and the /metrics counters; synthetic
# model tp 1 and 2 (router_prefix_cache), the default model tp 1 and Qwen2.5-Coder 0.5B tp 2
# when given (router_prefix_cache_models; CI runs it in Release).
if(TANDEM_PYTHON)
  set(RT_PC_ARGS)
  if(TANDEM_MODEL)
    list(APPEND RT_PC_ARGS --model "${TANDEM_MODEL}")
  endif()
  if(TANDEM_MODEL_QWEN05)
    list(APPEND RT_PC_ARGS --model-tp2 "${TANDEM_MODEL_QWEN05}")
  endif()
  add_test(NAME router_prefix_cache
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/router/test_prefix_cache.py
                   ${RT_TEST_BINS})
  set_tests_properties(router_prefix_cache PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 600)
  if(RT_PC_ARGS)
    add_test(NAME router_prefix_cache_models
             COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/router/test_prefix_cache.py
                     ${RT_TEST_BINS} ${RT_PC_ARGS} --model-only)
    set_tests_properties(router_prefix_cache_models PROPERTIES FIXTURES_REQUIRED synth_models
                         TIMEOUT 600)
  endif()
endif()

# router_prefix_tier: the decode prefix cache's second tier (tests/router/test_prefix_tier.py):
# a conversation evicted from a small pool into a file tier comes back (cached_tokens, tier
# metrics) and its greedy text == a cold cluster's, at tp 1 and tp 2; disaggregated tp 2 refused.
# router_prefix_tier_default: the default model at tp 1 (CI runs it in Release).
if(TANDEM_PYTHON)
  add_test(NAME router_prefix_tier
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/router/test_prefix_tier.py
                   ${RT_TEST_BINS})
  set_tests_properties(router_prefix_tier PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 600)
  if(TANDEM_MODEL)
    add_test(NAME router_prefix_tier_default
             COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/router/test_prefix_tier.py
                     ${RT_TEST_BINS} --model "${TANDEM_MODEL}" --model-only)
    set_tests_properties(router_prefix_tier_default PROPERTIES FIXTURES_REQUIRED synth_models
                         TIMEOUT 600)
  endif()
endif()
