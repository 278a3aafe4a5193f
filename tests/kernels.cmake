# Kernel tests: dequantization, matmul and get_rows of the CPU backend.
add_executable(test_matmul ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_matmul.c)
target_include_directories(test_matmul PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(test_matmul PRIVATE td_kernels td_common)
add_test(NAME test_matmul COMMAND test_matmul)

# K-quant types (Q4_K, Q5_K, Q6_K): dequantization bit for bit, matmul on both paths.
add_executable(test_kquant ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_kquant.c)
target_include_directories(test_kquant PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(test_kquant PRIVATE td_kernels td_common)
add_test(NAME test_kquant_matmul COMMAND test_kquant)

# Micro-benchmark of the matmul paths against the machine's ceilings (not run by ctest):
#   bin/bench_matmul [threads...]
add_executable(bench_matmul ${CMAKE_CURRENT_SOURCE_DIR}/kernels/bench_matmul.c)
target_link_libraries(bench_matmul PRIVATE td_kernels td_common)

# K-quant matmul speed next to Q4_1 and Q8_0 on one shape (not run by ctest):
#   bin/bench_kquant [threads [rows cols]]
add_executable(bench_kquant ${CMAKE_CURRENT_SOURCE_DIR}/kernels/bench_kquant.c)
target_link_libraries(bench_kquant PRIVATE td_kernels td_common)

# The matmul paths of every 32-weight block type on one shape, side by side (not run by
# ctest): bin/bench_qtypes [threads [rows cols]]
add_executable(bench_qtypes ${CMAKE_CURRENT_SOURCE_DIR}/kernels/bench_qtypes.c)
target_link_libraries(bench_qtypes PRIVATE td_kernels td_common)

# Not a test: the q8 GEMMs on AMX-INT8 against AVX512-VNNI, alternated, on Qwen2.5-0.5B's and
# SmolLM2-135M's shapes: bin/bench_q8amx [threads [m]]
add_executable(bench_q8amx ${CMAKE_CURRENT_SOURCE_DIR}/kernels/bench_q8amx.c)
target_include_directories(bench_q8amx PRIVATE ${PROJECT_SOURCE_DIR}/kernels/cpu)
target_link_libraries(bench_q8amx PRIVATE td_kernels td_common)

# kernels/kn_elem.h (the per-element math the CUDA kernels share with the CPU): its
# dequantizers bit for bit against kn_dequant_row, fp16 conversions, silu/GELU/rope.
add_executable(test_elem ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_elem.c)
target_include_directories(test_elem PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(test_elem PRIVATE td_kernels td_common)
add_test(NAME kernels.test_elem COMMAND test_elem)

# The CUDA backend against the CPU backend (matmul on both paths, matmul_mixed's solo
# rows, get_rows, rmsnorm, swiglu); without a GPU only its clear refusal is checked.
if(TANDEM_CUDA)
  add_executable(test_cuda ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_cuda.c)
  target_include_directories(test_cuda PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_link_libraries(test_cuda PRIVATE td_kernels td_common)
  add_test(NAME kernels.test_cuda COMMAND test_cuda)
endif()

# The opt-in 8-bit activation mode (Q4_K, Q6_K, Q5_0, Q8_0): against float64 of the
# quantized math and the float32 path, batch invariance, the mode off bit for bit.
add_executable(test_q8act ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_q8act.c)
target_include_directories(test_q8act PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}
                                              ${PROJECT_SOURCE_DIR}/kernels/cpu)
target_link_libraries(test_q8act PRIVATE td_kernels td_common)
add_test(NAME kernels.test_q8act COMMAND test_q8act)

# The 16-bit activation mode (Q4_0, Q4_1, Q5_0, Q8_0 on the dot path): against float64 of the
# quantized math and of the unquantized x, the same bits over threads, rows alone, row ranges,
# packed weights, the AVX2 and scalar forms and the fused dot path; the rest stays float32.
add_executable(test_q16act ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_q16act.c)
target_include_directories(test_q16act PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}
                                               ${PROJECT_SOURCE_DIR}/kernels/cpu)
target_link_libraries(test_q16act PRIVATE td_kernels td_common)
add_test(NAME kernels.test_q16act COMMAND test_q16act)

# The AMX-INT8 form of the q8 GEMMs against the AVX512-VNNI form, bit for bit; skipped (77)
# where AMX is unusable (no AMX, the OS refuses the tile state, TANDEM_CPU_AMX=0).
add_executable(test_q8amx ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_q8amx.c)
target_include_directories(test_q8amx PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}
                                              ${PROJECT_SOURCE_DIR}/kernels/cpu)
target_link_libraries(test_q8amx PRIVATE td_kernels td_common)
add_test(NAME kernels.test_q8amx COMMAND test_q8amx)
set_tests_properties(kernels.test_q8amx PROPERTIES SKIP_RETURN_CODE 77)

# The float32 gemm path's bf16x3 products on AMX-BF16 against float64 and against dequantize +
# sgemm (relative error per row), rows alone against the batch bit for bit, the backend's matmul
# at 1-3 threads; skipped (77) where AMX-BF16 is unusable or TANDEM_CPU_AMX=0.
add_executable(test_bf16amx ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_bf16amx.c)
target_include_directories(test_bf16amx PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}
                                                ${PROJECT_SOURCE_DIR}/kernels/cpu)
target_link_libraries(test_bf16amx PRIVATE td_kernels td_common)
add_test(NAME kernels.test_bf16amx COMMAND test_bf16amx)
set_tests_properties(kernels.test_bf16amx PROPERTIES SKIP_RETURN_CODE 77)

# The CPU backend's thread pool: every item once in its static part, idle workers and a
# waiting caller sleep (CPU time), the spin budget's environment variable (~1 s).
add_executable(test_pool ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_pool.c)
target_include_directories(test_pool PRIVATE ${PROJECT_SOURCE_DIR}/kernels/cpu)
target_link_libraries(test_pool PRIVATE td_kernels td_common)
add_test(NAME kernels.test_pool COMMAND test_pool)

# The bit-equality tests of the products again on OpenBLAS's oldest x86-64 kernels
# ("Prescott", what a VM that masks the CPU's model gets): a claim of equal bits must not
# hold only for one BLAS kernel set (issue 39: test_q8act once did).
foreach(t test_q8act test_q16act test_fused test_matmul test_kquant)
  add_test(NAME kernels.${t}_blas_prescott COMMAND ${t})
  # (test binaries never re-execute themselves to fix the core: kn_blas_fit_cpu is the
  # servers' and the CLI's)
  set_tests_properties(kernels.${t}_blas_prescott PROPERTIES ENVIRONMENT
                       "OPENBLAS_CORETYPE=Prescott")
endforeach()

# The mixture-of-experts routing (kernels/moe_route.h: softmax, sigmoid with bias and
# groups, the grouping by expert, a token alone as in a batch) and the combine op.
add_executable(test_moe_route ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_moe_route.c)
target_include_directories(test_moe_route PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(test_moe_route PRIVATE td_kernels td_common)
add_test(NAME kernels.test_moe_route COMMAND test_moe_route)
