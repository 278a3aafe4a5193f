# grammar/: the schema compiler, matcher and token masks; the mask cost bench is a tool.
add_executable(test_grammar ${CMAKE_CURRENT_SOURCE_DIR}/grammar/test_grammar.c)
target_include_directories(test_grammar PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_link_libraries(test_grammar PRIVATE td_grammar td_common)
add_test(NAME grammar COMMAND test_grammar)
# The per-token grammar cost over recorded documents (BENCHMARKS.md "Structured output"); a tool,
# not a test: tools/bench_grammar.py --record writes its input.
add_executable(bench_grammar_mask ${CMAKE_CURRENT_SOURCE_DIR}/grammar/bench_mask.c)
target_link_libraries(bench_grammar_mask PRIVATE td_grammar td_kernels td_common m)
