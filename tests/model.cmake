# Engine exactness on synthetic models: PP/TP splits, chunking, batching, bad batches.
add_executable(test_model_split ${CMAKE_CURRENT_SOURCE_DIR}/kernels/test_model_split.c)
target_link_libraries(test_model_split PRIVATE td_kernels td_common)

if(TANDEM_PYTHON)
  foreach(arch llama qwen2 qwen3 gemma3)
    set(extra "")
    if(arch STREQUAL "llama")
      set(extra --rope-freqs)
    endif()
    add_test(NAME model_split_synth_${arch}
             COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/make_synth.py
                     --out ${TANDEM_TEST_DATA}/split-${arch}.gguf --arch ${arch} --types mixed
                     --seed 11 ${extra})
    set_tests_properties(model_split_synth_${arch} PROPERTIES FIXTURES_SETUP split_${arch})
    add_test(NAME model_split_${arch}
             COMMAND test_model_split ${TANDEM_TEST_DATA}/split-${arch}.gguf)
    set_tests_properties(model_split_${arch} PROPERTIES FIXTURES_REQUIRED split_${arch}
                         TIMEOUT 600)
  endforeach()
endif()

# The split shapes issue 13 added: an FFN width TP 2/4 do not cut into whole 32-blocks
# (uneven split) with an odd, tied vocabulary (uneven vocab-parallel LM head over
# token_embd's rows), and K-type row-parallel tensors whose TP slices are re-quantized.
if(TANDEM_PYTHON)
  foreach(var odd kquant)
    if(var STREQUAL "odd")
      set(args --arch llama --types mixed --n-ff 544 --n-vocab 509 --tied --seed 12)
    else()
      set(args --arch qwen2 --types kquant --n-ff 768 --seed 13)
    endif()
    add_test(NAME model_split_synth_${var}
             COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/ref/make_synth.py
                     --out ${TANDEM_TEST_DATA}/split-${var}.gguf ${args})
    set_tests_properties(model_split_synth_${var} PROPERTIES FIXTURES_SETUP split_${var})
    add_test(NAME model_split_${var}
             COMMAND test_model_split ${TANDEM_TEST_DATA}/split-${var}.gguf)
    set_tests_properties(model_split_${var} PROPERTIES FIXTURES_REQUIRED split_${var}
                         TIMEOUT 600)
  endforeach()
endif()
