#define CATCH_CONFIG_MAIN
// LibTorch brings glog, whose CHECK macro would shadow Catch's: use the CATCH_ prefixed macros.
#define CATCH_CONFIG_PREFIX_ALL
#include <catch2/catch.hpp>
