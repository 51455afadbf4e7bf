// The test target's precompiled header (tests/CMakeLists.txt): the heavy headers most test files
// include, parsed once instead of in each.
#pragma once
#include <doctest/doctest.h>
#include <nlohmann/json.hpp>
