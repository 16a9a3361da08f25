// LibTorch brings glog, whose CHECK macro would shadow Catch's: use the CATCH_ prefixed macros.
#include "support/catch_runner.h"

int main(int argc, char* argv[]) { return dcp::testing::RunCatchSession(argc, argv); }
