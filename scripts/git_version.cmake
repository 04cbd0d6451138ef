# Writes OUT (a header defining SIGMA_GIT_HASH: the source tree's commit, "-dirty" when it has
# uncommitted changes, "unknown" outside git) when its content changes; run at every build, so
# `sigma eval --json` names the commit it was built from (docs/evaluation.md).
execute_process(COMMAND git -C ${SRC} describe --always --dirty --abbrev=12
                OUTPUT_VARIABLE hash OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR hash STREQUAL "")
  set(hash "unknown")
endif()
set(text "#define SIGMA_GIT_HASH \"${hash}\"\n")
if(EXISTS ${OUT})
  file(READ ${OUT} old)
endif()
if(NOT "${old}" STREQUAL "${text}")
  file(WRITE ${OUT} "${text}")
endif()
