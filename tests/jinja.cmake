# The chat-template engine (jinja/): constructs one at a time (test_jinja.c). The corpus of
# real templates against transformers' rendering is tests/templates.cmake.
add_executable(test_jinja jinja/test_jinja.c)
target_link_libraries(test_jinja PRIVATE td_jinja)
add_test(NAME jinja COMMAND test_jinja)
