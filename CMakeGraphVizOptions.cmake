# `cmake --graphviz=deps.dot build`: the libraries and what each links, without tests, tools or
# external libraries (run from the source root, or copy this file into the build directory).
set(GRAPHVIZ_EXTERNAL_LIBS FALSE)
set(GRAPHVIZ_EXECUTABLES FALSE)
set(GRAPHVIZ_GENERATE_PER_TARGET FALSE)
set(GRAPHVIZ_GENERATE_DEPENDERS FALSE)
set(GRAPHVIZ_IGNORE_TARGETS "test_main;.*_tests;.*bench.*;Catch2.*")
