# CPU backend element ops and paged attention (kernels/cpu/cpu_ops.c, cpu_attention.c).
foreach(t test_ops test_attention)
  add_executable(${t} ${CMAKE_CURRENT_SOURCE_DIR}/kernels/${t}.c)
  target_include_directories(${t} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_link_libraries(${t} PRIVATE td_kernels)
  add_test(NAME kernels.${t} COMMAND ${t})
endforeach()

# The fused ops (kernels/cpu/cpu_fused.c) against the unfused sequences, bit for bit; with a
# model, the engine's logits with and without them (TANDEM_CPU_FUSED=0): a synthetic qwen2
# (silu, mixed types), gemma3 (gelu), qwen3moe and deepseek2 (experts_ffn), the default model
# and the real K-quant files if set.
add_executable(test_fused ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_fused.c)
target_link_libraries(test_fused PRIVATE td_kernels td_common)
add_test(NAME kernels.test_fused COMMAND test_fused)
if(TANDEM_PYTHON)
  foreach(arch qwen2 gemma3 qwen3moe deepseek2)
    add_test(NAME engine_fused_${arch} COMMAND test_fused ${TANDEM_TEST_DATA}/split-${arch}.gguf)
    set_tests_properties(engine_fused_${arch} PROPERTIES FIXTURES_REQUIRED split_${arch}
                         TIMEOUT 300)
  endforeach()
endif()
if(TANDEM_MODEL)
  add_test(NAME engine_fused_default COMMAND test_fused ${TANDEM_MODEL})
  set_tests_properties(engine_fused_default PROPERTIES TIMEOUT 300)
endif()
# real K-quant files: mixed q/k/v types and biases (Qwen2.5 0.5B), gelu (Gemma 3 270M)
if(TANDEM_MODEL_QWEN05)
  add_test(NAME engine_fused_qwen05 COMMAND test_fused ${TANDEM_MODEL_QWEN05})
  set_tests_properties(engine_fused_qwen05 PROPERTIES TIMEOUT 300 LABELS models)
endif()
if(TANDEM_MODEL_GEMMA3)
  add_test(NAME engine_fused_gemma3_270m COMMAND test_fused ${TANDEM_MODEL_GEMMA3})
  set_tests_properties(engine_fused_gemma3_270m PROPERTIES TIMEOUT 300 LABELS models)
endif()
# Not a test: batch-1 decode fused vs TANDEM_CPU_FUSED=0, alternated in one process
#   bin/bench_fused MODEL [THREADS [ROUNDS [TOKENS]]]
add_executable(bench_fused ${CMAKE_CURRENT_SOURCE_DIR}/kernels/bench_fused.c)
target_link_libraries(bench_fused PRIVATE td_kernels td_common)

# The KV pool's sliced layout (kernels/kv_pool.h): every tile where kvxfer's kvx_layout_off
# puts it, refusals, kv_write/attention and the tier's copies bit for bit against the
# head-major pool; with the default model, the engine's logits (cpu, and cpu-dev with the
# staged download of a sliced device pool).
add_executable(test_kv_slicing ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_kv_slicing.c)
target_include_directories(test_kv_slicing PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(test_kv_slicing PRIVATE td_kernels td_kvxfer td_common)
add_test(NAME kernels.test_kv_slicing COMMAND test_kv_slicing)
if(TANDEM_MODEL)
  add_test(NAME kv_slicing_default COMMAND test_kv_slicing ${TANDEM_MODEL})
  set_tests_properties(kv_slicing_default PROPERTIES TIMEOUT 300)
endif()
