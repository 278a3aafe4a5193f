# config.cmake: tests of the cluster YAML (common/config.c).
#   config   a table of bad files (written into the build tree) each giving the expected
#            FILE:LINE:COLUMN message; a good file with every value checked; sizes; and
#            the examples in deploy/ load.
add_executable(test_config config/test_config.c)
target_link_libraries(test_config PRIVATE td_config td_common)
target_include_directories(test_config PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
add_test(NAME config
  COMMAND test_config ${TANDEM_TEST_DATA}/config
          ${PROJECT_SOURCE_DIR}/deploy/local.yaml ${PROJECT_SOURCE_DIR}/deploy/local-tp3.yaml)
set_tests_properties(config PROPERTIES TIMEOUT 60)
