# The package_consumer test: install this build into a fresh prefix, configure and build
# tests/package_consumer against it with find_package(msa), run what it built.
# -D BUILD_DIR, SOURCE_DIR, WORK_DIR, GENERATOR.
file(REMOVE_RECURSE "${WORK_DIR}")
execute_process(COMMAND ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix"
                RESULT_VARIABLE result OUTPUT_QUIET)
if(result)
  message(FATAL_ERROR "cmake --install failed: ${result}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
                        "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix" -DCMAKE_BUILD_TYPE=Release
                RESULT_VARIABLE result)
if(result)
  message(FATAL_ERROR "configuring the consumer failed: ${result}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build "${WORK_DIR}/build" RESULT_VARIABLE result)
if(result)
  message(FATAL_ERROR "building the consumer failed: ${result}")
endif()
execute_process(COMMAND "${WORK_DIR}/build/consumer" RESULT_VARIABLE result)
if(result)
  message(FATAL_ERROR "the consumer failed: ${result}")
endif()
if(EXISTS "${WORK_DIR}/build/consumer_runtime")
  execute_process(COMMAND "${WORK_DIR}/build/consumer_runtime" "${WORK_DIR}/model" RESULT_VARIABLE result)
  if(result)
    message(FATAL_ERROR "the runtime consumer failed: ${result}")
  endif()
endif()
