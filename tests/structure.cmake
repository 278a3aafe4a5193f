# Structure rules of the C code (issue 12; docs/contributing.md): function and file sizes, the
# one monotonic clock, names defined in one module only, header type prefixes, no include
# cycles inside a module, the layers, other folders' public headers only. Plain python3
# (standard library), no build needed.
#   structure           scripts/check_structure.py over the source tree: every violation as
#                       FILE:LINE: [rule] reason
#   structure_selftest  the same rules over the fixtures in tests/structure/tree: each rule
#                       must report exactly the lines marked "EXPECT: rule" there
add_test(NAME structure
         COMMAND python3 ${PROJECT_SOURCE_DIR}/scripts/check_structure.py --root ${PROJECT_SOURCE_DIR})
set_tests_properties(structure PROPERTIES TIMEOUT 60)
add_test(NAME structure_selftest
         COMMAND python3 ${PROJECT_SOURCE_DIR}/scripts/check_structure.py --self-test
                 --root ${PROJECT_SOURCE_DIR})
set_tests_properties(structure_selftest PROPERTIES TIMEOUT 60)
