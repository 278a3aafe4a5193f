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

# cpu_act auto (kernels/act_check.h): the measured choice of the activation mode per model,
# its cache and lock, on the default model (f32) and Qwen2.5-Coder 0.5B (q8) when fetched.
# cli_act_check_qwen05: the Qwen verdict alone (CI runs it in Release).
if(TANDEM_PYTHON AND TANDEM_MODEL)
  add_test(NAME cli_act_check
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/tools/test_act_check.py
                   $<TARGET_FILE:tandem> ${TANDEM_MODEL})
  set_tests_properties(cli_act_check PROPERTIES TIMEOUT 900)
endif()
if(TANDEM_PYTHON AND TANDEM_MODEL_QWEN05)
  add_test(NAME cli_act_check_qwen05
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/tools/test_act_check.py
                   $<TARGET_FILE:tandem> - ${TANDEM_MODEL_QWEN05})
  set_tests_properties(cli_act_check_qwen05 PROPERTIES TIMEOUT 900)
endif()
