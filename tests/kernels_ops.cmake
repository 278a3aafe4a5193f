# CPU backend element ops and paged attention (kernels/cpu/cpu_ops.c, cpu_attention.c).
foreach(t test_ops test_attention)
  add_executable(${t} ${CMAKE_CURRENT_SOURCE_DIR}/kernels/${t}.c)
  target_include_directories(${t} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  target_link_libraries(${t} PRIVATE td_kernels)
  add_test(NAME kernels.${t} COMMAND ${t})
endforeach()
