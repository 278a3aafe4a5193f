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
