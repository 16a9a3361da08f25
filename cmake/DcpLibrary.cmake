# dcp_add_library(name SOURCES ... HEADERS ... [PUBLIC_DEPS ...] [PRIVATE_DEPS ...])
# HEADERS are the folder's public headers, the ones installed; every other header is internal.
# One shared library per folder. Every header of ours is included under the dcp/ prefix, in the
# tree and by users: "dcp/<file>.h" for the dcp/ folder, "dcp/<folder>/<file>.h" for proto/,
# planner/ and storage/ ("dcp/<folder>/<sub>/<file>.h" for a header in a sub-folder). They install
# to include/dcp/ and include/dcp/<folder>/[<sub>/], and the exported include dir is include/,
# so an application's own "proto/error.h" can never be mistaken for ours.
# In the build tree, include/dcp/<folder> links to the source folder (see dcp_include_root).
function(dcp_include_root)
  set(root ${PROJECT_BINARY_DIR}/include/dcp)
  file(MAKE_DIRECTORY ${root})
  foreach(folder proto planner storage)
    if(NOT EXISTS ${root}/${folder})
      file(CREATE_LINK ${PROJECT_SOURCE_DIR}/${folder} ${root}/${folder} SYMBOLIC)
    endif()
  endforeach()
endfunction()

# EXPORT names the export set (default dcpTargets, the core): each optional part (MPI, Torch, NCCL)
# has its own, so find_package(dcp) needs their dependencies only when asked for them as
# COMPONENTS (cmake/dcpConfig.cmake.in).
function(dcp_add_library name)
  cmake_parse_arguments(ARG "" "EXPORT" "SOURCES;HEADERS;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  if(NOT ARG_EXPORT)
    set(ARG_EXPORT dcpTargets)
  endif()
  add_library(${name} SHARED ${ARG_SOURCES})
  target_compile_options(${name} PRIVATE ${DCP_WARNINGS})
  target_include_directories(${name} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>
    $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/include>
    $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/generated>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_link_libraries(${name} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  dcp_installed_rpath(${name})
  install(TARGETS ${name} EXPORT ${ARG_EXPORT}
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
    RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  file(RELATIVE_PATH folder ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR})
  if(folder STREQUAL "dcp")
    set(destination ${CMAKE_INSTALL_INCLUDEDIR}/dcp)
  else()
    set(destination ${CMAKE_INSTALL_INCLUDEDIR}/dcp/${folder})
  endif()
  # A header in a sub-folder keeps it ("backends/s3/s3_store.h" ->
  # include/dcp/storage/backends/s3/), as its include path in the tree does.
  foreach(header IN LISTS ARG_HEADERS)
    get_filename_component(subfolder ${header} DIRECTORY)
    install(FILES ${header} DESTINATION ${destination}/${subfolder})
  endforeach()
endfunction()
