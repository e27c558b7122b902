# Makes the usage examples of the public headers (include/gradsync/*.h) and of README.md's
# "Using it" section into one GoogleTest source: each example becomes the body of a test of the
# HeaderExample fixture (tests/header_example.h). The test suite builds and runs it, so an
# example that no longer compiles breaks the build with an error at its own line of the header
# or README (a `#line` directive precedes each body), and one that throws fails its test.
#
#   cmake -DSOURCE_DIR=<repository root> -DOUTPUT=<generated .cc> -P tests/extract_examples.cmake
#
# How a header marks an example: a comment line that is exactly `// Example:` (indented as the
# comment it is part of), then the example, every line of it `//   ` (two slashes, three
# spaces) followed by C++. A line that is only `//` is a blank line inside it; the first other
# line ends it. What is not C++ (a step the example leaves out) is a comment inside it:
#
#   // Example:
#   //   auto ctx = gradsync::init();
#   //   // ... compute the gradient ...
#   //   ctx->allreduce(grad.data(), grad.data(), grad.size(), gradsync::DataType::kFloat32,
#   //                  gradsync::ReduceOp::kAvg);
#
# In README.md every ```cpp block of the "Using it" section is an example.
#
# Each test is named after the file and the line its example starts on: reducer_h_7 is the
# example of include/gradsync/reducer.h that starts on line 7.
#
# An example may use, undeclared, what the fixture declares (a world-of-one `ctx`, `grad`,
# `parameters`...: see tests/header_example.h); its `#include` lines move to the top of the
# generated file. A header line `//   ...;` outside every example is an error: it reads as code
# whose `// Example:` marker is missing, and such an example would escape the test.
cmake_minimum_required(VERSION 3.25)

if(NOT SOURCE_DIR OR NOT OUTPUT)
  message(FATAL_ERROR "usage: cmake -DSOURCE_DIR=<repository root> -DOUTPUT=<generated .cc> "
                      "-P ${CMAKE_CURRENT_LIST_FILE}")
endif()

# CMake lists split at ';', group at '[' and ']', and escape with '\': C++ lines hold all of
# them, so while lines are list elements each of these characters is a placeholder naming its
# code, put back when the C++ is written out.
set(LIST_SPECIAL_CODES 92 59 91 93)

function(read_lines path out_var)
  file(READ "${path}" text)
  foreach(code IN LISTS LIST_SPECIAL_CODES)
    string(ASCII ${code} special)
    string(REPLACE "${special}" "<gs:${code}>" text "${text}")
  endforeach()
  string(REPLACE "\n" ";" lines "${text}")
  set(${out_var} "${lines}" PARENT_SCOPE)
endfunction()

function(decode text out_var)
  foreach(code IN LISTS LIST_SPECIAL_CODES)
    string(ASCII ${code} special)
    string(REPLACE "<gs:${code}>" "${special}" text "${text}")
  endforeach()
  set(${out_var} "${text}" PARENT_SCOPE)
endfunction()

set(tests "")     # the generated tests, decoded C++
set(includes "")  # the examples' #include lines, hoisted out of the test bodies

# Appends to `tests` one test whose body is `body` (lines still encoded), the code of the
# example in `path` whose first line is `first_line`.
function(add_example path first_line body)
  get_filename_component(file_name "${path}" NAME)
  string(MAKE_C_IDENTIFIER "${file_name}_${first_line}" test_name)
  set(code "")
  foreach(line IN LISTS body)
    decode("${line}" line)
    # An include inside a function body would be wrong; a blank keeps the lines counted.
    if(line MATCHES "^ *#include ")
      string(STRIP "${line}" line)
      list(APPEND includes "${line}")
      set(line "")
    endif()
    string(APPEND code "${line}\n")
  endforeach()
  string(APPEND tests "\nTEST_F(HeaderExample, ${test_name}) {\n"
                      "#line ${first_line} \"${path}\"\n${code}}\n")
  set(tests "${tests}" PARENT_SCOPE)
  set(includes "${includes}" PARENT_SCOPE)
endfunction()

# The examples of one header, marked as described at the top.
function(extract_header_examples path)
  read_lines("${path}" lines)
  list(APPEND lines "")  # ends an example that ends the file
  set(number 0)
  set(in_example FALSE)
  foreach(line IN LISTS lines)
    math(EXPR number "${number} + 1")
    if(in_example)
      string(FIND "${line}" "${indent}//   " code_at)
      if(code_at EQUAL 0 OR line STREQUAL "${indent}//")
        # Two spaces for the slashes keep the columns of the header in the compiler's messages.
        string(LENGTH "${indent}//" prefix_length)
        string(SUBSTRING "${line}" ${prefix_length} -1 code)
        list(APPEND body "${indent}  ${code}")
        continue()
      endif()
      if(NOT body MATCHES "[^ ;]")
        message(FATAL_ERROR "${path}:${marker_line}: `// Example:` with no example after it: "
                            "each of its lines starts with `//` and three spaces")
      endif()
      add_example("${path}" ${first_line} "${body}")
      set(in_example FALSE)
    endif()
    if(line MATCHES "^( *)// Example:$")
      set(in_example TRUE)
      set(indent "${CMAKE_MATCH_1}")
      set(marker_line ${number})
      math(EXPR first_line "${number} + 1")
      set(body "")
    elseif(line MATCHES "^ *//   [^ ].*<gs:59>$")
      message(FATAL_ERROR "${path}:${number}: this comment line reads as example code, but no "
                          "`// Example:` line marks its block, so no test compiles it")
    endif()
  endforeach()
  set(tests "${tests}" PARENT_SCOPE)
  set(includes "${includes}" PARENT_SCOPE)
endfunction()

# The ```cpp blocks of README.md's "Using it" section.
function(extract_readme_examples path)
  read_lines("${path}" lines)
  set(number 0)
  set(section_found FALSE)
  set(in_section FALSE)
  set(in_block FALSE)
  foreach(line IN LISTS lines)
    math(EXPR number "${number} + 1")
    if(line MATCHES "^## ")
      set(in_section FALSE)
      if(line STREQUAL "## Using it")
        set(in_section TRUE)
        set(section_found TRUE)
      endif()
    elseif(in_block)
      if(line STREQUAL "```")
        add_example("${path}" ${first_line} "${body}")
        set(in_block FALSE)
      else()
        list(APPEND body "${line}")
      endif()
    elseif(in_section AND line STREQUAL "```cpp")
      set(in_block TRUE)
      math(EXPR first_line "${number} + 1")
      set(body "")
    endif()
  endforeach()
  if(NOT section_found)
    message(FATAL_ERROR "${path}: no \"## Using it\" section, whose ```cpp blocks are examples")
  endif()
  if(in_block)
    message(FATAL_ERROR "${path}:${first_line}: a ```cpp block that no ``` closes")
  endif()
  set(tests "${tests}" PARENT_SCOPE)
  set(includes "${includes}" PARENT_SCOPE)
endfunction()

file(GLOB headers "${SOURCE_DIR}/include/gradsync/*.h")
set(header_includes "")
foreach(header IN LISTS headers)
  get_filename_component(header_name "${header}" NAME)
  string(APPEND header_includes "#include \"gradsync/${header_name}\"\n")
  extract_header_examples("${header}")
endforeach()
extract_readme_examples("${SOURCE_DIR}/README.md")

list(REMOVE_DUPLICATES includes)
list(JOIN includes "\n" example_includes)
string(CONCAT generated
       "// Generated by tests/extract_examples.cmake from the examples in include/gradsync/*.h\n"
       "// and README.md: edit them, not this file.\n"
       "${header_includes}"
       "${example_includes}\n\n"
       "#include \"header_example.h\"\n"
       "${tests}")
# Written only when it changes, so that editing a header's prose recompiles nothing.
file(WRITE "${OUTPUT}.new" "${generated}")
file(COPY_FILE "${OUTPUT}.new" "${OUTPUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUTPUT}.new")
