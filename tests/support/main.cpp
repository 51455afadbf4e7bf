#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "lib/core/dnnl_context.hpp"
#include "tests/support/reference.hpp"

int main(int argc, char** argv) {
  xfb::DnnlContext::instance().set_threads(xfb::test::kTestThreads);
  doctest::Context context(argc, argv);
  return context.run();
}
