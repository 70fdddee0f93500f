// The one source of each "<library>_alone" shared object (tests/CMakeLists.txt): the
// library itself comes in whole through the link line, so this file holds nothing.
