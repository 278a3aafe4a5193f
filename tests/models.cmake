# Real model files served through `tandem up` (tests/models/test_real_models.py): the
# Qwen2.5-Coder 0.5B Q4_K_M file (TANDEM_MODEL_QWEN05; scripts/test.sh fetches it with
# setup.sh --models qwen0.5b) in several cluster shapes, each asked the same greedy prompts
# (chat and completions, max_tokens 32, two streamed) through the HTTP API; every shape must
# answer exactly as the first (text, finish_reason, token counts), "Paris" included.
#   models_qwen05_colocated_pd  colocated tp 1 (reference), prefill pp 1 -> decode tp 1,
#                               prefill pp 2 -> decode tp 1
#   models_qwen05_tp2           colocated tp 1 (reference), colocated tp 2, prefill pp 1 ->
#                               decode tp 2 (FFN 4864 / 2 is not whole 256-blocks: ffn_down's
#                               Q4_K/Q6_K slices are re-quantized to Q8_0 at load; the greedy
#                               answers stay identical on this prompt set)
# RUN_SERIAL: each cluster runs 2-4 processes of a 0.5B model on a 2-core machine.
# Measured (ASan RelWithDebInfo, 2 cores shared with other builds, load ~4.3):
# models_qwen05_colocated_pd 180 s wall, 42 + 70 + 68 s per shape; CPU seconds of the
# cluster processes 69 + 69 + 66 (the test prints both for every run).
set(TANDEM_MODELS_ARGS "")
if(TANDEM_SANITIZE)
  set(TANDEM_MODELS_ARGS --asan)
endif()
if(TANDEM_PYTHON AND TANDEM_MODEL_QWEN05)
  foreach(case colocated_pd tp2)
    set(shapes colocated,pd,pd_pp2)
    if(case STREQUAL "tp2")
      set(shapes colocated,colocated_tp2,pd_tp2)
    endif()
    add_test(NAME models_qwen05_${case}
             COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/models/test_real_models.py
                     --tandem $<TARGET_FILE:tandem> --decode $<TARGET_FILE:tandem-decode>
                     --prefill $<TARGET_FILE:tandem-prefill> --router $<TARGET_FILE:tandem-router>
                     --model ${TANDEM_MODEL_QWEN05} --shapes ${shapes} ${TANDEM_MODELS_ARGS})
    set_tests_properties(models_qwen05_${case} PROPERTIES TIMEOUT 900 RUN_SERIAL TRUE
                         LABELS models ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
  endforeach()
endif()

# Gemma 3 270M Q4_K_M (TANDEM_MODEL_GEMMA3; a base model without a chat template, so the
# router renders with the gemma family and no answer is checked for "Paris"): 4 heads over
# 1 KV head, so decode tp 2 replicates the KV head on both ranks and the KV transfer fills
# both copies (common/td_tp.h). colocated tp 1 (reference), colocated tp 2, prefill pp 1 ->
# decode tp 2, prefill pp 2 -> decode tp 1. Release: 17 s.
if(TANDEM_PYTHON AND TANDEM_MODEL_GEMMA3)
  add_test(NAME models_gemma3_tp2
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/models/test_real_models.py
                   --tandem $<TARGET_FILE:tandem> --decode $<TARGET_FILE:tandem-decode>
                   --prefill $<TARGET_FILE:tandem-prefill> --router $<TARGET_FILE:tandem-router>
                   --model ${TANDEM_MODEL_GEMMA3} --chat-template gemma --base
                   --shapes colocated,colocated_tp2,pd_tp2,pd_pp2 ${TANDEM_MODELS_ARGS})
  set_tests_properties(models_gemma3_tp2 PROPERTIES TIMEOUT 900 RUN_SERIAL TRUE
                       LABELS models ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
endif()
