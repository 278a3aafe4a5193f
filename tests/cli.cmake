# The tandem CLI end to end: error messages and exit codes, seeds, greedy invariance, and
# (with TANDEM_MODEL) a known chat answer. Needs the synthetic models fixture.
if(TANDEM_PYTHON)
  add_test(NAME cli
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/tools/test_cli.sh $<TARGET_FILE:tandem>
                   ${TANDEM_TEST_DATA}/synth/llama.gguf ${TANDEM_MODEL})
  set_tests_properties(cli PROPERTIES FIXTURES_REQUIRED synth_models TIMEOUT 600)
endif()
