add_executable(test_sampler ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_sampler.c)
target_link_libraries(test_sampler PRIVATE td_kernels td_common)
add_test(NAME sampler COMMAND test_sampler)

add_executable(test_logprobs ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_logprobs.c)
target_link_libraries(test_logprobs PRIVATE td_kernels td_common m)
add_test(NAME logprobs COMMAND test_logprobs)

add_executable(test_kv_cache ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_kv_cache.c)
target_link_libraries(test_kv_cache PRIVATE td_kernels td_common)
add_test(NAME kv_cache COMMAND test_kv_cache)

# the KV memory facade (kvmem/kv_mem.h): blocks, sequences, rollback, renewing the pool
add_executable(test_kv_mem ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_kv_mem.c)
target_link_libraries(test_kv_mem PRIVATE td_kvmem td_common)
add_test(NAME kv_mem COMMAND test_kv_mem)

add_executable(test_kv_tier ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_kv_tier.c)
target_link_libraries(test_kv_tier PRIVATE td_kernels td_common)
add_test(NAME kv_tier COMMAND test_kv_tier)

# kn_sample over a CPU pool draws the one-thread sampler's tokens, and both a plain
# reference's (49152-token vocabulary: several parts per pass)
add_executable(test_sampler_pool ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_sampler_pool.c)
target_link_libraries(test_sampler_pool PRIVATE td_kernels td_common m)
add_test(NAME sampler_pool COMMAND test_sampler_pool)
