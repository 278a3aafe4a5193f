# Kernel tests: dequantization, matmul and get_rows of the CPU backend.
add_executable(test_matmul ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_matmul.c)
target_include_directories(test_matmul PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(test_matmul PRIVATE td_kernels td_common)
add_test(NAME test_matmul COMMAND test_matmul)

# Micro-benchmark of the matmul paths against the machine's ceilings (not run by ctest):
#   bin/bench_matmul [threads...]
add_executable(bench_matmul ${CMAKE_CURRENT_SOURCE_DIR}/kernels/bench_matmul.c)
target_link_libraries(bench_matmul PRIVATE td_kernels td_common)

# The matmul paths of every 32-weight block type on one shape, side by side (not run by
# ctest): bin/bench_qtypes [threads [rows cols]]
add_executable(bench_qtypes ${CMAKE_CURRENT_SOURCE_DIR}/kernels/bench_qtypes.c)
target_link_libraries(bench_qtypes PRIVATE td_kernels td_common)
