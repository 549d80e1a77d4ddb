// The one exit path every tool shares: errors become one line, an error file and an exit status.
#include <sys/wait.h>
#include <unistd.h>
#include <catch2/catch.hpp>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "../apps/app_main.hpp"

namespace fs = std::filesystem;

// Under lorarun, rank 1 can write its error file, then rank 0 end first: the launcher's SIGTERM
// reaches rank 1 on its way out. Had it killed rank 1, the launcher would report rank 1 (whose
// error came first) as killed by a signal, exit 1, and spend a restart on a recipe error.
TEST_CASE("a tool that has written its error file exits with its own status through a SIGTERM that comes after") {
  const fs::path file = fs::temp_directory_path() / fmt::format("lorarun-app-main-{}.json", getpid());
  fs::remove(file);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    setenv("TORCHELASTIC_ERROR_FILE", file.c_str(), 1);
    setenv("LORARUN_ERROR_SUMMARY", "1", 1);  // the line goes to the file alone
    const int status = lorarun::app_main("lora-train", 0, nullptr, [](int, char**) -> int {
      throw lorarun::ConfigError("unknown key 'train.learning_rate'");
    });
    raise(SIGTERM);  // the launcher's, before this process has ended
    _exit(status);
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  CHECK_FALSE(WIFSIGNALED(status));
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == lorarun::kExitConfig);
  std::ifstream in(file);
  const std::string text{std::istreambuf_iterator<char>(in), {}};
  CHECK_THAT(text, Catch::Contains("lora-train: error: unknown key 'train.learning_rate'"));
  fs::remove(file);
}
