# gguf.cmake: tests of the GGUF reader (common/gguf.c).
#   gguf_reader     built-in cases: a hand-built file and its truncations, empty file,
#                   directory, missing path (no data needed)
#   gguf_corpus     fixture: tests/ref/make_malformed.py writes the malformed corpus
#   gguf_malformed  every corpus file fails cleanly (or opens, when valid); the corpus's
#                   valid synthetic model matches the gguf package's reading of it
#   gguf_model      the default model (TANDEM_MODEL) matches the gguf package's reading
# test_gguf is built from the reader's own sources so it does not wait on the rest of
# td_common.
add_executable(test_gguf
  ${CMAKE_CURRENT_SOURCE_DIR}/common/test_gguf.c
  ${PROJECT_SOURCE_DIR}/common/gguf.c
  ${PROJECT_SOURCE_DIR}/common/td_dtype.c
  ${PROJECT_SOURCE_DIR}/common/td_err.c
  ${PROJECT_SOURCE_DIR}/common/td_clock.c)
target_include_directories(test_gguf PRIVATE ${PROJECT_SOURCE_DIR}/common ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(test_gguf PRIVATE Threads::Threads m)

add_test(NAME gguf_reader COMMAND test_gguf)
set_tests_properties(gguf_reader PROPERTIES TIMEOUT 60)

if(TANDEM_PYTHON)
  set(TANDEM_GGUF_CORPUS ${TANDEM_TEST_DATA}/gguf-corpus)
  add_test(NAME gguf_corpus
    COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/make_malformed.py --out ${TANDEM_GGUF_CORPUS})
  set_tests_properties(gguf_corpus PROPERTIES FIXTURES_SETUP gguf_corpus TIMEOUT 120
                       ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
  add_test(NAME gguf_malformed
    COMMAND test_gguf --corpus ${TANDEM_GGUF_CORPUS}
            --expect ${TANDEM_GGUF_CORPUS}/valid.gguf ${TANDEM_GGUF_CORPUS}/valid.expect)
  set_tests_properties(gguf_malformed PROPERTIES FIXTURES_REQUIRED gguf_corpus TIMEOUT 300)

  if(TANDEM_MODEL)
    add_test(NAME gguf_model_expect
      COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/gguf_expect.py
              ${TANDEM_MODEL} ${TANDEM_TEST_DATA}/default-model.expect)
    set_tests_properties(gguf_model_expect PROPERTIES FIXTURES_SETUP gguf_model_expect TIMEOUT 300
                         ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
    add_test(NAME gguf_model
      COMMAND test_gguf --expect ${TANDEM_MODEL} ${TANDEM_TEST_DATA}/default-model.expect)
    set_tests_properties(gguf_model PROPERTIES FIXTURES_REQUIRED gguf_model_expect TIMEOUT 300)
  endif()
else()
  message(STATUS "TANDEM_PYTHON not set: GGUF corpus and model tests are not registered")
endif()
