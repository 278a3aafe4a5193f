# gpu.cmake: the GPU suite (label "gpu"; scripts/test-gpu.sh runs it on a machine with a GPU).
# Each test exits 77 (ctest: skipped) with its reason on one line where the CUDA backend
# cannot run, so the CPU-only suite registers them and reports them as skipped, not passed.
#   gpu_parity_synth    CUDA against CPU on the synthetic qwen2 model (mixed weight types)
#   gpu_parity_default  the same on the default model (SmolLM2-135M Q4_1)
#   gpu_parity_qwen05   the same on Qwen2.5-Coder 0.5B Q4_K_M (Q5_0, Q8_0, Q4_K, Q6_K)
#   gpu_serve_synth     a colocated cluster on backend cuda through `tandem up`: 8 prompts at
#   gpu_serve_default   once, each answer equal to `tandem generate --backend cuda`
if(TANDEM_PYTHON)
  set(gpu_models "synth=${TANDEM_TEST_DATA}/synth/qwen2.gguf")
  if(TANDEM_MODEL)
    list(APPEND gpu_models "default=${TANDEM_MODEL}")
  endif()
  if(TANDEM_MODEL_QWEN05)
    list(APPEND gpu_models "qwen05=${TANDEM_MODEL_QWEN05}")
  endif()
  foreach(entry ${gpu_models})
    string(REPLACE "=" ";" parts "${entry}")
    list(GET parts 0 name)
    list(GET parts 1 file)
    add_test(NAME gpu_parity_${name}
             COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/gpu/test_gpu_parity.py
                     --tandem $<TARGET_FILE:tandem> --model ${file})
    set_tests_properties(gpu_parity_${name} PROPERTIES LABELS gpu SKIP_RETURN_CODE 77
                         TIMEOUT 900 FIXTURES_REQUIRED synth_models)
    if(NOT name STREQUAL "qwen05")
      add_test(NAME gpu_serve_${name}
               COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/gpu/test_gpu_serve.py
                       --tandem $<TARGET_FILE:tandem> --model ${file})
      set_tests_properties(gpu_serve_${name} PROPERTIES LABELS gpu SKIP_RETURN_CODE 77
                           TIMEOUT 900 FIXTURES_REQUIRED synth_models)
    endif()
  endforeach()
endif()
