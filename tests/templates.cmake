# Chat templates (issue 41): every template of the corpus (llama.cpp's models/templates, from
# the llama-cpp-python sdist; scripts/fetch_corpus.py) rendered by `tandem template` byte for
# byte as transformers' apply_chat_template renders it, for each conversation in
# tests/templates/conversations (tests/templates/README.md).
#   template_corpus  tests/templates/test_template_corpus.py: reference (tests/ref/
#                    template_reference.py, in process) against one `tandem template` run per
#                    case; known refusals in tests/templates/exceptions.txt
# Needs the venv (transformers, jinja2) and the corpus: without TANDEM_CORPUS (scripts/test.sh
# fetches it and passes it) the test is not defined.
if(TANDEM_PYTHON AND TANDEM_CORPUS AND TARGET tandem)
  add_test(NAME template_corpus
           COMMAND ${TANDEM_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/templates/test_template_corpus.py
                   --tandem $<TARGET_FILE:tandem> --corpus ${TANDEM_CORPUS})
  set_tests_properties(template_corpus PROPERTIES TIMEOUT 300)
endif()

# The models' own templates: tokenizer.chat_template (and each tokenizer.chat_template.NAME) of
# each model file, bos/eos from its vocabulary, against `tandem template --model FILE`, which
# reads the same from the file (tests/templates/README.md). One test per model, so each stays
# short (gguf's GGUFReader parses the whole vocabulary, several seconds for Gemma's 262k
# tokens) and they run in parallel. Gemma 3 270M is a base model without a chat template:
# its test checks that tandem refuses it with a message, as apply_chat_template raises.
#   template_models_smollm2  TANDEM_MODEL (SmolLM2-135M-Instruct)
#   template_models_qwen05   TANDEM_MODEL_QWEN05 (Qwen2.5-Coder-0.5B-Instruct)
#   template_models_gemma3   TANDEM_MODEL_GEMMA3 (gemma-3-270m)
if(TANDEM_PYTHON AND TARGET tandem)
  foreach(pair smollm2:TANDEM_MODEL qwen05:TANDEM_MODEL_QWEN05 gemma3:TANDEM_MODEL_GEMMA3)
    string(REPLACE ":" ";" pair ${pair})
    list(GET pair 0 label)
    list(GET pair 1 var)
    if(${var})
      add_test(NAME template_models_${label}
               COMMAND ${TANDEM_PYTHON}
                       ${CMAKE_CURRENT_SOURCE_DIR}/templates/test_template_corpus.py
                       --tandem $<TARGET_FILE:tandem> --model ${${var}})
      set_tests_properties(template_models_${label} PROPERTIES TIMEOUT 120)
    endif()
  endforeach()
endif()

# `tandem template`'s own paths: family names, errors as a user sees them, bad inputs
add_test(NAME template_cli COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/tools/test_template_cli.sh
                                   $<TARGET_FILE:tandem>)
