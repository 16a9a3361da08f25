// What the C++ half of the Python package shares between its files (module.cc, torch_plugin.cc):
// raising dcp's errors as the package's exception classes, and calling into dcp without the GIL.
// Internal to dcp/python.
#pragma once

#include <pybind11/pybind11.h>

#include "dcp/proto/error.h"

namespace dcp_python {

namespace py = pybind11;

/// Raises the Python exception of `e`'s category (classes defined in dcp/__init__.py) with the
/// message; a CollectiveError also carries its phase and each failing rank's (rank, code, text).
[[noreturn]] void RaiseAsPython(const dcp::Error& e);

/// Runs `fn` without the GIL, turning dcp's errors into Python exceptions.
template <typename Fn>
auto Call(Fn&& fn) -> decltype(fn()) {
  try {
    py::gil_scoped_release release;
    return fn();
  } catch (const dcp::Error& e) {
    RaiseAsPython(e);
  }
}

/// dcp.torch's C++ half: the classes TorchWriter and TorchReader (torch_plugin.cc).
void BindTorchPlugin(py::module_& m);

}  // namespace dcp_python
