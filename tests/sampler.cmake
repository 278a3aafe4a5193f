add_executable(test_sampler ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_sampler.c)
target_link_libraries(test_sampler PRIVATE td_kernels td_common)
add_test(NAME sampler COMMAND test_sampler)
