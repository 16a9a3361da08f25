# How CTest reports the s3:// unit tests where no S3 test server runs (issue 43: 24 cases and 4
# stubs "passed with a warning"). Runs the unit tests named s3/sigv4 of TEST_DIR under a CTest of
# their own with DCP_TEST_S3_ENDPOINT unset, and fails when
#   - one printed "SKIPPED: " and was reported passed (a skip CTest cannot see),
#   - one was reported skipped without saying why ("SKIPPED: <reason>" in its output),
#   - one failed (a case that needs the server and does not skip without it), or
#   - none was skipped at all (every build has some: the server's cases, or the stubs of a
#     build without the backend).
#
#   cmake -DCTEST=<ctest> -DTEST_DIR=<build>/tests -DWORK_DIR=<scratch> -P s3_skip_check.cmake
cmake_minimum_required(VERSION 3.18)
if(CMAKE_VERSION VERSION_LESS 3.21)
  message(STATUS "s3_skip_check SKIPPED: ctest ${CMAKE_VERSION} has no --output-junit (3.21)")
  return()
endif()
foreach(var CTEST TEST_DIR WORK_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "s3_skip_check.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(junit "${WORK_DIR}/junit.xml")
execute_process(
  COMMAND ${CMAKE_COMMAND} -E env --unset=DCP_TEST_S3_ENDPOINT
          ${CTEST} --test-dir "${TEST_DIR}" -L unit -R "s3|sigv4" -E "^s3_skips_reported$" -j 2
          --output-junit "${junit}"
  RESULT_VARIABLE rc
  OUTPUT_VARIABLE out
  ERROR_VARIABLE out)
if(NOT EXISTS "${junit}")
  message(FATAL_ERROR "the inner ctest wrote no report (exit ${rc}):\n${out}")
endif()
file(READ "${junit}" xml)

set(passed 0)
set(skipped 0)
set(problems "")
set(rest "${xml}")
while(TRUE)
  string(FIND "${rest}" "<testcase " begin)
  if(begin EQUAL -1)
    break()
  endif()
  string(SUBSTRING "${rest}" ${begin} -1 rest)
  string(FIND "${rest}" "</testcase>" end)
  if(end EQUAL -1)
    message(FATAL_ERROR "the inner ctest's report is cut short:\n${rest}")
  endif()
  string(SUBSTRING "${rest}" 0 ${end} case)
  math(EXPR end "${end} + 11")
  string(SUBSTRING "${rest}" ${end} -1 rest)
  string(REGEX MATCH "name=\"([^\"]*)\"" unused "${case}")
  set(name "${CMAKE_MATCH_1}")
  string(REGEX MATCH "status=\"([^\"]*)\"" unused "${case}")
  set(status "${CMAKE_MATCH_1}")
  string(FIND "${case}" "SKIPPED: " says_skipped)
  if(status STREQUAL "run")
    math(EXPR passed "${passed} + 1")
    if(NOT says_skipped EQUAL -1)
      string(APPEND problems "\n  reported PASSED, but it skipped: ${name}")
    endif()
  elseif(status STREQUAL "notrun")
    math(EXPR skipped "${skipped} + 1")
    if(says_skipped EQUAL -1)
      string(APPEND problems "\n  reported skipped without a reason (SKIPPED: ...): ${name}")
    endif()
  else()
    string(APPEND problems "\n  ${status} without a server: ${name}")
  endif()
endwhile()
if(skipped EQUAL 0)
  string(APPEND problems "\n  no s3 test was reported skipped")
endif()
message(STATUS "without an S3 test server: ${skipped} s3 tests reported skipped (with their "
               "reasons), ${passed} passed (they need no server)")
if(NOT problems STREQUAL "")
  message(FATAL_ERROR "s3 tests misreported where no S3 test server runs:${problems}\n"
                      "(inner ctest output:)\n${out}")
endif()
