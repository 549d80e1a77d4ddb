// Errors meant for the user: one line that names the problem and the fix.
#pragma once
#include <stdexcept>
#include <string>

namespace lorarun {

// Thrown for bad input or environment; each main catches it once, prints it, exits non-zero.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// An error this rank saw but another rank caused (it stopped or hung): `rank` is that rank, which
// the error file records so that the launcher's summary names it rather than the rank that noticed
// (-1: some other rank, not known which).
struct PeerError : Error {
  PeerError(int rank, const std::string& message) : Error(message), rank(rank) {}
  int rank;
};

}  // namespace lorarun
