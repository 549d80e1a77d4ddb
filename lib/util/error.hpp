// Errors meant for the user: one line that names the problem and the fix.
#pragma once
#include <stdexcept>
#include <string>

namespace lorarun {

// Thrown for bad input or environment; each main catches it once, prints it, exits non-zero.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Bad input that running the same command again cannot change: a recipe error, an output
// directory another run owns, a missing model. The tools exit kExitConfig for it, which the
// launcher (lorarun --max-restarts) does not restart.
struct ConfigError : Error {
  using Error::Error;
};
inline constexpr int kExitConfig = 78;  // sysexits' EX_CONFIG

// An error this rank saw but another rank caused (it stopped or hung): `rank` is that rank, which
// the error file records so that the launcher's summary names it rather than the rank that noticed
// (-1: some other rank, not known which).
struct PeerError : Error {
  PeerError(int rank, const std::string& message) : Error(message), rank(rank) {}
  int rank;
};

}  // namespace lorarun
