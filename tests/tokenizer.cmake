# Tokenizer and chat template tests (tests/common/test_tokenizer.c, test_chat_template.c).
# The python-driven ones build their reference data (and synthetic GGUF tokenizers) into
# ${TANDEM_TEST_DATA}/tok with tests/ref/tok_reference.py, then run the C driver on it.
add_executable(test_tokenizer common/test_tokenizer.c)
target_link_libraries(test_tokenizer PRIVATE td_common)
add_executable(test_chat_template common/test_chat_template.c)
target_link_libraries(test_chat_template PRIVATE td_common)
target_include_directories(test_tokenizer PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_include_directories(test_chat_template PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})

add_test(NAME chat_template COMMAND test_chat_template)

if(TANDEM_PYTHON)
  set(_tok_ref ${CMAKE_CURRENT_SOURCE_DIR}/ref/tok_reference.py)
  set(_tok_args --tok-bin $<TARGET_FILE:test_tokenizer> --chat-bin $<TARGET_FILE:test_chat_template>
                --out ${TANDEM_TEST_DATA}/tok)
  foreach(case llama3 qwen2 spm unsupported chat_llama3)
    add_test(NAME tok_${case} COMMAND ${TANDEM_PYTHON} ${_tok_ref} --case ${case} ${_tok_args})
  endforeach()
  if(TANDEM_MODEL)
    foreach(case smollm2 smollm2_nospecial chat_smollm2)
      add_test(NAME tok_${case}
               COMMAND ${TANDEM_PYTHON} ${_tok_ref} --case ${case} --model ${TANDEM_MODEL} ${_tok_args})
    endforeach()
  endif()
endif()
