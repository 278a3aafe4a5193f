# reference.cmake: the engine against independent references (tests/ref/*.py).
#   synth_models  fixture: make_synth.py --suite writes the synthetic models (llama with
#                 rope_freqs, qwen2, qwen3, llama f32, gemma3, gemma2, smollm3, granite, phi3,
#                 olmo2; mixed weight types) into
#                 ${TANDEM_TEST_DATA}/synth
#   gguf_synth    the GGUF reader reads the synthetic llama model as the gguf package does
#   reference     `tandem logits` / `tandem generate` vs the numpy forward pass
#                 (ref_forward.py) on the synthetic models and, with TANDEM_MODEL, on the
#                 default model: logits rel L2 < 1e-3, same greedy tokens
#   dequant       `tandem dequant` vs gguf.quants.dequantize, bit-exact (Q4_1 and Q5_1
#                 within the FMA bound, see test_dequant.py)
#   dequant_kquant  the same for random Q4_K/Q5_K/Q6_K super-blocks (test_kquant_ref.py)
#   reference_qwen05  `reference` on Qwen2.5-Coder 0.5B Q4_K_M (TANDEM_MODEL_QWEN05; Q5_0,
#                 Q8_0, Q4_K, Q6_K weights; scripts/test.sh fetches it): two chat prompts and
#                 the long text prompt (about 5 min of the numpy reference on 2 cores)
# Nothing here is registered without TANDEM_PYTHON; the default-model parts are skipped
# without TANDEM_MODEL.
if(NOT TANDEM_PYTHON)
  message(STATUS "TANDEM_PYTHON not set: reference tests are not registered")
  return()
endif()

set(TANDEM_SYNTH_DIR ${TANDEM_TEST_DATA}/synth)
set(TANDEM_REF_DIR ${CMAKE_CURRENT_SOURCE_DIR}/ref)
# keep the source tree free of __pycache__
set(TANDEM_PY_ENV "PYTHONDONTWRITEBYTECODE=1")

add_test(NAME synth_models
  COMMAND ${TANDEM_PYTHON} ${TANDEM_REF_DIR}/make_synth.py --suite ${TANDEM_SYNTH_DIR})
set_tests_properties(synth_models PROPERTIES FIXTURES_SETUP synth_models TIMEOUT 300
                     ENVIRONMENT "${TANDEM_PY_ENV}")

add_test(NAME gguf_synth
  COMMAND test_gguf --expect ${TANDEM_SYNTH_DIR}/llama.gguf ${TANDEM_SYNTH_DIR}/llama.expect)
set_tests_properties(gguf_synth PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 120)

set(TANDEM_REF_MODEL_ARGS "")
if(TANDEM_MODEL)
  set(TANDEM_REF_MODEL_ARGS --model ${TANDEM_MODEL})
else()
  message(STATUS "TANDEM_MODEL not set: reference tests run on the synthetic models only")
endif()

if(TARGET tandem)
  set(TANDEM_BIN $<TARGET_FILE:tandem>)
else()
  # the scripts fail with "engine binary '' is missing", which is the truth
  set(TANDEM_BIN "")
endif()

# reference: the synthetic models (every architecture); reference_default: the default model
# (CI runs it in Release: tests/CMakeLists.txt, TANDEM_CI_RELEASE_TESTS)
add_test(NAME reference
  COMMAND ${TANDEM_PYTHON} ${TANDEM_REF_DIR}/test_reference.py --tandem "${TANDEM_BIN}"
          --synth-dir ${TANDEM_SYNTH_DIR})
set_tests_properties(reference PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 1800
                     ENVIRONMENT "${TANDEM_PY_ENV}")
if(TANDEM_MODEL)
  add_test(NAME reference_default
    COMMAND ${TANDEM_PYTHON} ${TANDEM_REF_DIR}/test_reference.py --tandem "${TANDEM_BIN}"
            ${TANDEM_REF_MODEL_ARGS})
  set_tests_properties(reference_default PROPERTIES TIMEOUT 1800 ENVIRONMENT "${TANDEM_PY_ENV}")
endif()

add_test(NAME dequant
  COMMAND ${TANDEM_PYTHON} ${TANDEM_REF_DIR}/test_dequant.py --tandem "${TANDEM_BIN}"
          --synth-dir ${TANDEM_SYNTH_DIR} ${TANDEM_REF_MODEL_ARGS})
set_tests_properties(dequant PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 900
                     ENVIRONMENT "${TANDEM_PY_ENV}")

# K-quant dequantization (Q4_K, Q5_K, Q6_K) of `tandem dequant` vs gguf.quants.dequantize on
# random super-blocks written to a GGUF file of its own: bit-exact (0 ulp, see the script)
add_test(NAME dequant_kquant
  COMMAND ${TANDEM_PYTHON} ${TANDEM_REF_DIR}/test_kquant_ref.py --tandem "${TANDEM_BIN}")
set_tests_properties(dequant_kquant PROPERTIES TIMEOUT 300 ENVIRONMENT "${TANDEM_PY_ENV}")

if(TANDEM_MODEL_QWEN05)
  add_test(NAME reference_qwen05
    COMMAND ${TANDEM_PYTHON} ${TANDEM_REF_DIR}/test_reference.py --tandem "${TANDEM_BIN}"
            --model ${TANDEM_MODEL_QWEN05} --label qwen0.5b --prompts 0,1,6)
  set_tests_properties(reference_qwen05 PROPERTIES TIMEOUT 1800 ENVIRONMENT "${TANDEM_PY_ENV}")
endif()

# reference_llamacpp: the engine and ref_forward.py against llama.cpp itself
# (vs_llamacpp.py: F32 synthetic models of every architecture, rel L2 < 1e-4 and identical
# greedy tokens). Registered only with -DTANDEM_LLAMACPP_DIR=<llama.cpp tree built with
# libllama.so>: llama.cpp is never part of the repository, and CI has none.
if(TANDEM_LLAMACPP_DIR)
  add_test(NAME reference_llamacpp
    COMMAND ${TANDEM_PYTHON} ${TANDEM_REF_DIR}/vs_llamacpp.py --tandem "${TANDEM_BIN}"
            --llama-dir ${TANDEM_LLAMACPP_DIR})
  set_tests_properties(reference_llamacpp PROPERTIES TIMEOUT 900 ENVIRONMENT "${TANDEM_PY_ENV}")
endif()

# prompt_logprobs: /v1/completions echo + logprobs + max_tokens 0 (prompt logprobs) on the
# synthetic llama model against log_softmax of ref_forward.py's logits, colocated and
# disaggregated (prefill pp 2), f32 KV (test_prompt_logprobs.py: the tolerance and why).
if(TARGET tandem-router AND TARGET tandem-decode AND TARGET tandem-prefill)
  add_test(NAME prompt_logprobs
    COMMAND ${TANDEM_PYTHON} ${TANDEM_REF_DIR}/test_prompt_logprobs.py
            --router $<TARGET_FILE:tandem-router> --decode $<TARGET_FILE:tandem-decode>
            --prefill $<TARGET_FILE:tandem-prefill> --tandem ${TANDEM_BIN}
            --model ${TANDEM_SYNTH_DIR}/llama.gguf)
  set_tests_properties(prompt_logprobs PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 600
                       ENVIRONMENT "${TANDEM_PY_ENV}")
endif()
