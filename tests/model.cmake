# Engine exactness on synthetic models: PP/TP splits, chunking, batching, bad batches.
# Checked against the float32 path (1e-4 in the logits), so with sgemm: on a CPU with
# AMX-BF16 the gemm path's bf16x3 products carry ~2^-17 relative error of their own
# (kernels.test_bf16amx checks that path against float64), which is not a split's doing.
set(split_env "TANDEM_CPU_AMX=0")
add_executable(test_model_split ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_model_split.c)
target_link_libraries(test_model_split PRIVATE td_kernels td_common)

# olmo2 normalizes Q and K over every head at once: tp 1 only (its PP splits, chunking and
# batching are checked, and the refusal of tp 2). qwen3moe and deepseek2 split their
# experts across TP ranks; deepseek2's latent KV head is on every rank.
if(TANDEM_PYTHON)
  foreach(arch llama qwen2 qwen3 gemma3 smollm3 granite phi3 olmo2 qwen3moe deepseek2 gemma2)
    set(extra "")
    set(tp_arg "")
    if(arch STREQUAL "llama")
      set(extra --rope-freqs)
    elseif(arch STREQUAL "olmo2")
      set(tp_arg --tp 1)
    endif()
    add_test(NAME model_split_synth_${arch}
             COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/make_synth.py
                     --out ${TANDEM_TEST_DATA}/split-${arch}.gguf --arch ${arch} --types mixed
                     --seed 11 ${extra})
    set_tests_properties(model_split_synth_${arch} PROPERTIES FIXTURES_SETUP split_${arch})
    add_test(NAME model_split_${arch}
             COMMAND test_model_split ${TANDEM_TEST_DATA}/split-${arch}.gguf ${tp_arg})
    set_tests_properties(model_split_${arch} PROPERTIES FIXTURES_REQUIRED split_${arch}
                         TIMEOUT 600 ENVIRONMENT "${split_env}")
  endforeach()
endif()

# Data-parallel attention (kn_shard.dp_size): dp 2 and 3 members on threads against the
# unsplit model, on the split tests' synthetic qwen3moe and deepseek2 (llama: the dense
# model dp refuses).
add_executable(test_model_dp ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_model_dp.c)
target_link_libraries(test_model_dp PRIVATE td_kernels td_common)
if(TANDEM_PYTHON)
  foreach(arch qwen3moe deepseek2)
    add_test(NAME model_dp_${arch}
             COMMAND test_model_dp ${TANDEM_TEST_DATA}/split-${arch}.gguf
                     ${TANDEM_TEST_DATA}/split-llama.gguf)
    set_tests_properties(model_dp_${arch} PROPERTIES
                         FIXTURES_REQUIRED "split_${arch};split_llama" TIMEOUT 300
                         ENVIRONMENT "${split_env}")
  endforeach()
endif()

# The split shapes issue 13 added: an FFN width TP 2/4 do not cut into whole 32-blocks
# (uneven split) with an odd, tied vocabulary (uneven vocab-parallel LM head over
# token_embd's rows), K-type row-parallel tensors whose TP slices are re-quantized, and KV
# heads shared between ranks (common/td_tp.h): 6 query heads over 2 KV heads at tp 2, 3
# (rank 1 holds both KV heads) and 6 (each KV head on three ranks), and the default 8
# over 4 at tp 8.
if(TANDEM_PYTHON)
  foreach(var odd kquant gqa)
    set(tp_arg "")
    if(var STREQUAL "odd")
      set(args --arch llama --types mixed --n-ff 544 --n-vocab 509 --tied --seed 12)
      set(tp_arg --tp 2,4,8)
    elseif(var STREQUAL "kquant")
      set(args --arch qwen2 --types kquant --n-ff 768 --seed 13)
    else()
      set(args --arch qwen2 --types mixed --n-head 6 --n-head-kv 2 --seed 14)
      set(tp_arg --tp 2,3,6)
    endif()
    add_test(NAME model_split_synth_${var}
             COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/make_synth.py
                     --out ${TANDEM_TEST_DATA}/split-${var}.gguf ${args})
    set_tests_properties(model_split_synth_${var} PROPERTIES FIXTURES_SETUP split_${var})
    add_test(NAME model_split_${var}
             COMMAND test_model_split ${TANDEM_TEST_DATA}/split-${var}.gguf ${tp_arg})
    set_tests_properties(model_split_${var} PROPERTIES FIXTURES_REQUIRED split_${var}
                         TIMEOUT 600 ENVIRONMENT "${split_env}")
  endforeach()
endif()

# The same checks on a real file: Qwen2.5-Coder 0.5B Q4_K_M (14 heads over 2 KV heads,
# FFN 4864) at pp 2/3 and tp 2/7 (tp 7: rank 3 holds both KV heads, the FFN splits
# unevenly, ffn_down's K-type slices are re-quantized). ~40 s on 2 cores.
if(TANDEM_MODEL_QWEN05)
  add_test(NAME model_split_qwen05
           COMMAND test_model_split ${TANDEM_MODEL_QWEN05} --tp 2,7)
  set_tests_properties(model_split_qwen05 PROPERTIES TIMEOUT 600 LABELS models
                       ENVIRONMENT "${split_env}")
endif()

# Gemma 3 270M Q4_K_M: 4 heads over 1 KV head, so tp 2 and 4 replicate the KV head on every
# rank (no row-parallel slice is cut: 1024-wide attn_output and ffn_down halves are whole
# 256-blocks). ~11 s on 2 cores.
if(TANDEM_MODEL_GEMMA3)
  add_test(NAME model_split_gemma3_270m
           COMMAND test_model_split ${TANDEM_MODEL_GEMMA3} --tp 2,4)
  set_tests_properties(model_split_gemma3_270m PROPERTIES TIMEOUT 600 LABELS models
                       ENVIRONMENT "${split_env}")
endif()

# The engine on a device-style backend (host_memory false): every op gets backend memory or
# mapped weights, never a host pointer, and the logits equal the CPU backend's bit for bit
# (tests/kernels/test_engine_device.c); also the clear refusals (cuda without a GPU, a
# shared pool in device memory).
add_executable(test_engine_device ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_engine_device.c)
target_link_libraries(test_engine_device PRIVATE td_kernels td_common)
# The same on deepseek2 (latent attention, experts with shared ones, a dense first layer):
# the router's logits go down and the plan up once per MoE layer.
if(TANDEM_PYTHON)
  add_test(NAME engine_device COMMAND test_engine_device ${TANDEM_TEST_DATA}/split-qwen2.gguf)
  set_tests_properties(engine_device PROPERTIES FIXTURES_REQUIRED split_qwen2 TIMEOUT 300)
  add_test(NAME engine_device_deepseek2
           COMMAND test_engine_device ${TANDEM_TEST_DATA}/split-deepseek2.gguf)
  set_tests_properties(engine_device_deepseek2 PROPERTIES FIXTURES_REQUIRED split_deepseek2
                       TIMEOUT 300)
  # and on gemma2: its soft-capped attention (attention_capped) through the device-style ops
  add_test(NAME engine_device_gemma2
           COMMAND test_engine_device ${TANDEM_TEST_DATA}/split-gemma2.gguf)
  set_tests_properties(engine_device_gemma2 PROPERTIES FIXTURES_REQUIRED split_gemma2 TIMEOUT 300)
endif()
