# Install the built project into a scratch prefix, then configure and build a downstream project
# that uses find_package(dcp) and links dcp::dcp, and run it.
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${WORK_DIR}/prefix
  RESULT_VARIABLE rc OUTPUT_QUIET)
if(rc)
  message(FATAL_ERROR "install failed: ${rc}")
endif()
# Installed libraries and programs find their libraries relative to themselves: no run path into
# the build tree, none that searches the current directory.
file(GLOB libdirs LIST_DIRECTORIES true ${WORK_DIR}/prefix/lib ${WORK_DIR}/prefix/lib/*-linux-gnu)
execute_process(COMMAND ${CMAKE_COMMAND} "-DDIRS=${libdirs};${WORK_DIR}/prefix/bin"
  -DFORBID=${BINARY_DIR} -P ${SOURCE_DIR}/tests/runpath_check.cmake RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "installed run paths are wrong")
endif()
# The Python package (where it was built): `import dcp` from the prefix alone, its module on dcp's
# installed libraries, not the build tree's; a save and a load_all through it.
if(DCP_PYTHON AND DCP_PYTHON_INSTALL_DIR)
  set(pydir ${WORK_DIR}/prefix/${DCP_PYTHON_INSTALL_DIR})
  execute_process(COMMAND ${CMAKE_COMMAND} -DDIRS=${pydir}/dcp -DFORBID=${BINARY_DIR}
    -P ${SOURCE_DIR}/tests/runpath_check.cmake RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "the installed Python module's run path is wrong")
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=PYTHONPATH PYTHONPATH=${pydir}
    ${DCP_PYTHON} ${SOURCE_DIR}/tests/package/python_installed.py ${WORK_DIR}/prefix
    ${WORK_DIR}/python-ckpt RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "the installed Python package does not work: ${rc}")
  endif()
endif()
# The installed package is relocatable: its exported targets name dependencies by target (torch,
# MPI::MPI_CXX, ...), never by a library path of the machine that built it.
file(GLOB target_files ${WORK_DIR}/prefix/lib*/cmake/dcp/dcpTargets*.cmake)
foreach(f IN LISTS target_files)
  file(STRINGS ${f} links REGEX "INTERFACE_LINK_LIBRARIES")
  foreach(line IN LISTS links)
    if(line MATCHES "/[^\";]*\\.so")
      message(FATAL_ERROR "${f} links a library by absolute path: ${line}")
    endif()
  endforeach()
endforeach()
# A raw-buffer program needs neither MPI nor LibTorch: both are hidden from this configure, so a
# config that looked for them fails here.
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/package -B ${WORK_DIR}/build
  -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON
  -DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring the consumer failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building the consumer failed: ${rc}")
endif()
execute_process(COMMAND ${WORK_DIR}/build/consumer RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "the consumer failed: ${rc}")
endif()
# Asking for a part that was not built fails with a message naming it.
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/package -B ${WORK_DIR}/build-none
  -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DDCP_CONSUMER_COMPONENTS=NoSuchPart
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc OR NOT "${out}${err}" MATCHES "NoSuchPart")
  message(FATAL_ERROR "find_package(dcp COMPONENTS NoSuchPart) did not fail naming it: ${out}${err}")
endif()
# Every part that was built, asked for by name: each target exists (the MPI one is built).
if(COMPONENTS)
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/package
    -B ${WORK_DIR}/build-components -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix
    "-DDCP_CONSUMER_COMPONENTS=${COMPONENTS}" RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "configuring the consumer with COMPONENTS ${COMPONENTS} failed: ${rc}")
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build-components
    RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "building the consumer with COMPONENTS ${COMPONENTS} failed: ${rc}")
  endif()
endif()
# README.md's code as a reader pastes it (tests/readme/readme_build.py): its whole program with its
# CMakeLists.txt, configured against the installed package, built and run at 2 ranks; every
# fragment compiled into a function of its own. Needs the MPI component (the program is an MPI
# job) and a Python to cut the README; without them this part is skipped, saying so.
list(FIND COMPONENTS MPI mpi_at)
if(NOT PYTHON OR mpi_at EQUAL -1 OR NOT MPIEXEC)
  message(STATUS "README.md's code not built: needs python3 and the MPI component")
  return()
endif()
set(readme_dir ${WORK_DIR}/readme)
execute_process(COMMAND ${PYTHON} ${SOURCE_DIR}/tests/readme/readme_build.py extract ${SOURCE_DIR}
  ${readme_dir} "${COMPONENTS}" RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "cutting README.md's code failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${readme_dir}/app -B ${readme_dir}/app/out
  -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "README.md's CMakeLists.txt does not configure against the package: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${readme_dir}/app/out RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "README.md's program does not build as pasted: ${rc}")
endif()
# Twice: the program must also run where its checkpoint already exists.
foreach(run 1 2)
  execute_process(COMMAND ${MPIEXEC} --oversubscribe -np 2 ${readme_dir}/app/out/app
    WORKING_DIRECTORY ${readme_dir} RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "README.md's program failed (run ${run}): ${rc}")
  endif()
endforeach()
if(NOT EXISTS ${readme_dir}/ckpt/step-1/metadata.dcp)
  message(FATAL_ERROR "README.md's program committed no checkpoint in ${readme_dir}/ckpt/step-1")
endif()
if(EXISTS ${readme_dir}/fragments/CMakeLists.txt)
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${readme_dir}/fragments
    -B ${readme_dir}/fragments/out -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "configuring README.md's fragments failed: ${rc}")
  endif()
  # Each fragment is a translation unit of its own: two at a time (CI has two cores).
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${readme_dir}/fragments/out --parallel 2
    RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "a README.md fragment does not compile as pasted (see the files in "
                        "${readme_dir}/fragments: each names its README line): ${rc}")
  endif()
endif()
