# Installs the libraries, their headers and a CMake package config so a host project
# can find_package(sluice) and link sluice::sluice.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

get_property(_sluice_targets GLOBAL PROPERTY SLUICE_EXPORTED_TARGETS)
install(TARGETS ${_sluice_targets} sluice EXPORT sluiceTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
if(TARGET sluice_cli)
  install(TARGETS sluice_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
foreach(dir runtime offload cache models)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${dir} DESTINATION include/sluice
          FILES_MATCHING PATTERN "*.h")
endforeach()
# The public API headers: <prefix>/include/sluice/{sluice.hpp,inspect.hpp,sluice.h}, included as <sluice/...>.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/sluice DESTINATION include FILES_MATCHING PATTERN "*.hpp" PATTERN "*.h")
install(EXPORT sluiceTargets NAMESPACE sluice:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/sluice)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/sluiceConfig.cmake.in
  ${PROJECT_BINARY_DIR}/sluiceConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/sluice)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/sluiceConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/sluiceConfig.cmake ${PROJECT_BINARY_DIR}/sluiceConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/sluice)
