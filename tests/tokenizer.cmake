# Tokenizer tests (tests/common/test_tokenizer.c; the chat templates are tests/jinja.cmake and
# tests/templates.cmake).
# The python-driven ones build their reference data (and synthetic GGUF tokenizers) into
# ${TANDEM_TEST_DATA}/tok with tests/ref/tok_reference.py, then run the C driver on it.
add_executable(test_tokenizer common/test_tokenizer.c)
target_link_libraries(test_tokenizer PRIVATE td_common)
target_include_directories(test_tokenizer PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})

if(TANDEM_PYTHON)
  set(_tok_ref ${CMAKE_CURRENT_SOURCE_DIR}/ref/tok_reference.py)
  set(_tok_args --tok-bin $<TARGET_FILE:test_tokenizer> --out ${TANDEM_TEST_DATA}/tok)
  foreach(case llama3 qwen2 spm unsupported)
    add_test(NAME tok_${case} COMMAND ${TANDEM_PYTHON} ${_tok_ref} --case ${case} ${_tok_args})
  endforeach()
  if(TANDEM_MODEL)
    foreach(case smollm2 smollm2_nospecial)
      add_test(NAME tok_${case}
               COMMAND ${TANDEM_PYTHON} ${_tok_ref} --case ${case} --model ${TANDEM_MODEL} ${_tok_args})
    endforeach()
  endif()
endif()

# llama.cpp's tokenizer test vocabularies (ggml-vocab-NAME.gguf with .inp/.out cases, from the
# corpus scripts/fetch_corpus.py fetches): one test per vocabulary, tok_corpus_NAME, each
# case's ids exactly and the decode round trip (tests/common/test_tok_corpus.c). The ones
# without cases take llama-bpe's inputs: their ids must be those tests/ref/vocab_ids/NAME.out
# holds (written by the llama.cpp that llama-cpp-python 0.3.36 vendors, from
# ggml-vocab-NAME.gguf and ggml-vocab-llama-bpe.gguf.inp, add_special and parse_special off).
# nomic-bert-moe (t5: Unigram with a precompiled charsmap) normalizes its input, so its
# decode is checked against the text llama.cpp's detokenize gives (NAME.dec), on the
# llama-bpe inputs and on texts of its own (nomic-bert-moe-extra.inp: accents, full-width
# letters, ligatures, whitespace runs, emoji, CJK, invalid UTF-8, ...); see
# tests/ref/vocab_ids/README.md for how those files were written.
add_executable(test_tok_corpus common/test_tok_corpus.c)
target_link_libraries(test_tok_corpus PRIVATE td_common)
target_include_directories(test_tok_corpus PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
# Unigram on small vocabularies built in the test: a hand-made charsmap, and malformed ones
# (truncated size, a size beyond the blob, units and strings pointing outside) refused
add_test(NAME tok_ugm_charsmap COMMAND test_tok_corpus --charsmap-cases)
if(TANDEM_CORPUS)
  set(_vocab ${TANDEM_CORPUS}/vocab/ggml-vocab)
  foreach(v bert-bge command-r deepseek-coder deepseek-llm falcon gemma-4 gpt-2 llama-bpe
            llama-spm mpt phi-3 qwen2 qwen35 refact starcoder)
    add_test(NAME tok_corpus_${v} COMMAND test_tok_corpus --vocab ${_vocab}-${v}.gguf)
  endforeach()
  foreach(v aquila baichuan gpt-neox)
    add_test(NAME tok_corpus_${v}
             COMMAND test_tok_corpus --vocab ${_vocab}-${v}.gguf --expect load
                     --texts ${_vocab}-llama-bpe.gguf.inp
                     --ids ${CMAKE_CURRENT_SOURCE_DIR}/ref/vocab_ids/${v}.out)
  endforeach()
  set(_ids ${CMAKE_CURRENT_SOURCE_DIR}/ref/vocab_ids)
  add_test(NAME tok_corpus_nomic-bert-moe
           COMMAND test_tok_corpus --vocab ${_vocab}-nomic-bert-moe.gguf --expect load
                   --texts ${_vocab}-llama-bpe.gguf.inp --ids ${_ids}/nomic-bert-moe.out
                   --decoded ${_ids}/nomic-bert-moe.dec)
  add_test(NAME tok_corpus_nomic-bert-moe_extra
           COMMAND test_tok_corpus --vocab ${_vocab}-nomic-bert-moe.gguf --expect load
                   --texts ${_ids}/nomic-bert-moe-extra.inp --ids ${_ids}/nomic-bert-moe-extra.out
                   --decoded ${_ids}/nomic-bert-moe-extra.dec)
  # the file's own charsmap, mutated: refused or loaded, never a crash
  add_test(NAME tok_ugm_charsmap_mutated
           COMMAND test_tok_corpus --charsmap-cases --vocab ${_vocab}-nomic-bert-moe.gguf)
  # `tandem tokenize` on the same vocabulary-only files (tests/tools/test_tokenize.sh)
  add_test(NAME tok_cli_tokenize
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/tools/test_tokenize.sh $<TARGET_FILE:tandem>
                   ${TANDEM_CORPUS}/vocab)
endif()
