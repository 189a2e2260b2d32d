# `cmake --install`: the CLI, the template indexer, the emulator (library and
# header), the JIT runtime (libraries and headers) and the `cudagen` CMake
# package, so that another project can
#   find_package(cudagen REQUIRED)
#   cudagen_add_graph(my_program model.json [EMULATE])     # ahead of time
#   target_link_libraries(my_program cudagen::runtime)     # JIT (runtime/jit.h)
# (examples/aot and examples/jit are such projects; the ctest
# `aot.installed_package` builds both against an installed prefix).
include(CMakePackageConfigHelpers)

set(CUDAGEN_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/cudagen)
set_target_properties(cudagen PROPERTIES EXPORT_NAME cudagen)
install(TARGETS cudagen EXPORT cudagenTargets RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(TARGETS cudagen-index RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
if(TARGET cudagen_emu)
  set_target_properties(cudagen_emu PROPERTIES EXPORT_NAME emu)
  install(TARGETS cudagen_emu EXPORT cudagenTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(FILES ${PROJECT_SOURCE_DIR}/runtime/emu/cudagen_emu.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/cudagen)
endif()
# The JIT runtime: static libraries (it links neither libclang, LLVM nor
# libcuda) and every header its API includes, in include/cudagen.
set_target_properties(cudagen_model PROPERTIES EXPORT_NAME model)
set_target_properties(cudagen_generator PROPERTIES EXPORT_NAME generator)
set_target_properties(cudagen_runtime PROPERTIES EXPORT_NAME runtime)
install(TARGETS cudagen_model cudagen_generator cudagen_runtime EXPORT cudagenTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
file(GLOB CUDAGEN_API_HEADERS ${PROJECT_SOURCE_DIR}/generator/*.h ${PROJECT_SOURCE_DIR}/runtime/*.h)
install(FILES ${CUDAGEN_API_HEADERS} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/cudagen)
install(EXPORT cudagenTargets NAMESPACE cudagen:: DESTINATION ${CUDAGEN_CMAKE_DIR})

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/cudagenConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/cudagenConfig.cmake INSTALL_DESTINATION ${CUDAGEN_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/cudagenConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/cudagenConfig.cmake ${PROJECT_BINARY_DIR}/cudagenConfigVersion.cmake
              ${PROJECT_SOURCE_DIR}/cmake/cudagenFunctions.cmake
        DESTINATION ${CUDAGEN_CMAKE_DIR})
