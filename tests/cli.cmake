# The tandem CLI end to end: error messages and exit codes, seeds, greedy invariance, and
# (with TANDEM_MODEL) a known chat answer. Needs the synthetic models fixture.
if(TANDEM_PYTHON)
  add_test(NAME cli
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/tools/test_cli.sh $<TARGET_FILE:tandem>
                   ${TANDEM_TEST_DATA}/synth/llama.gguf ${TANDEM_MODEL})
  set_tests_properties(cli PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 600)
endif()

# A BLAS that misreads the CPU (OPENBLAS_CORETYPE=Prescott): corrected by re-execution,
# or reported with TANDEM_BLAS_CORE=keep; bench-engine --json and the start-up log say
# what runs (kernels/cpu/cpu_blas.h).
if(TANDEM_PYTHON)
  add_test(NAME cli_blas_core
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/tools/test_blas_core.py
                   $<TARGET_FILE:tandem> ${TANDEM_TEST_DATA}/synth/llama.gguf)
  set_tests_properties(cli_blas_core PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 300)
endif()

# cpu_act auto (kernels/act_check.h): the measured choice of the activation mode per model.
# cli_act_check: the verdict's cache, its checksum and lock, on a synthetic model (ASan);
# cli_act_check_models: the default model's q16 and Qwen2.5-Coder 0.5B's q8 verdicts (CI runs
# it in Release: a measurement is 16 forward passes of a real model).
if(TANDEM_PYTHON)
  add_test(NAME cli_act_check
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/tools/test_act_check.py
                   $<TARGET_FILE:tandem> --cache ${TANDEM_TEST_DATA}/synth/llama.gguf)
  set_tests_properties(cli_act_check PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 300)
endif()
if(TANDEM_PYTHON AND (TANDEM_MODEL OR TANDEM_MODEL_QWEN05))
  set(ACT_CHECK_MODELS)
  if(TANDEM_MODEL)
    list(APPEND ACT_CHECK_MODELS --default ${TANDEM_MODEL})
  endif()
  if(TANDEM_MODEL_QWEN05)
    list(APPEND ACT_CHECK_MODELS --qwen ${TANDEM_MODEL_QWEN05})
  endif()
  add_test(NAME cli_act_check_models
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/tools/test_act_check.py
                   $<TARGET_FILE:tandem> ${ACT_CHECK_MODELS})
  set_tests_properties(cli_act_check_models PROPERTIES TIMEOUT 900)
endif()
