// Errors meant for the user: one line that names the problem and the fix.
#pragma once
#include <stdexcept>
#include <string>
#include <typeinfo>

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

// Within a catch block of an Error `e`: throws it again with `prefix` before its message, of the
// same kind where that is Error or ConfigError (what the launcher decides restarts by); other kinds
// pass as they are.
[[noreturn]] inline void rethrow_within(const Error& e, const std::string& prefix) {
  if (typeid(e) == typeid(ConfigError)) throw ConfigError(prefix + e.what());
  if (typeid(e) == typeid(Error)) throw Error(prefix + e.what());
  throw;
}

// Runs `f`; a plain Error it throws is thrown again as a ConfigError with the same message: for work
// on input a rerun reads again alike (a model's files, the adapter they start), where a plain Error
// means bad input. Errors of other kinds (a lost connection, another rank) pass as they are.
template <class F>
decltype(auto) as_input_error(F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    if (typeid(e) == typeid(Error)) throw ConfigError(e.what());
    throw;
  }
}

// An error this rank saw but another rank caused (it stopped or hung): `rank` is that rank, which
// the error file records so that the launcher's summary names it rather than the rank that noticed
// (-1: some other rank, not known which).
struct PeerError : Error {
  PeerError(int rank, const std::string& message) : Error(message), rank(rank) {}
  int rank;
};

}  // namespace lorarun
