// util/untrusted: the one grammar every name from a database or a file passes before it becomes
// part of a path, and the escaping of what is printed.
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "io/files.hpp"
#include "util/error.hpp"
#include "util/untrusted.hpp"

using namespace lorarun;
using namespace std::string_literals;

namespace {

// The hostile shapes a name from the database may take (the restore, pull and --adapter
// mongodb-run: tests use the same list).
const std::vector<std::string> kHostile = {"/etc/cron.d/x",
                                           "..",
                                           "../../../../etc/cron.d/x",
                                           "zzz/../..",
                                           "a/./b",
                                           "a//b",
                                           "a/",
                                           ".hidden",
                                           "-flag",
                                           "a\0b"s,
                                           std::string(300, 'a'),
                                           "\xff\xfe",
                                           "caf\xc3\xa9",
                                           "a b",
                                           "a\nb",
                                           "C:\\x",
                                           ""};

}  // namespace

TEST_CASE("names from outside: only the strict grammar passes") {
  for (const std::string& bad : kHostile) {
    INFO(printable(bad));
    CHECK_FALSE(is_name_component(bad));
    CHECK_FALSE(is_relative_file_name(bad));
    CHECK_FALSE(is_artifact_name(bad));
    CHECK_FALSE(is_adapter_name(bad));
    CHECK_FALSE(is_run_id(bad));
    CHECK_FALSE(is_database_name(bad));
  }
  for (const char* good : {"adapter_model.safetensors", "adapter_config.json", "best.json", "README.md", "a+b-c_d.e"})
    CHECK(is_name_component(good));
  CHECK(is_relative_file_name("sub/adapter_config.json"));
  CHECK_FALSE(is_relative_file_name("a/b/c/d/e/f/g/h/i"));  // nine parts
  CHECK(is_relative_file_name(std::string(128, 'a')));
  CHECK_FALSE(is_relative_file_name(std::string(129, 'a')));
  for (const char* good : {"best", "resume_state", "epoch_0", "epoch_12", "epoch_999999"})
    CHECK(is_artifact_name(good));
  for (const char* bad : {"epoch_", "epoch_01", "epoch_1000000", "epoch_-1", "epoch_1/..", "Best", "bench"})
    CHECK_FALSE(is_artifact_name(bad));
  // a job's adapters (adapters:): <adapter>/<artifact>, one level, the adapter a directory name of its own
  for (const char* good : {"acme/epoch_0", "tenant-7/best", "a+b/resume_state"}) CHECK(is_artifact_name(good));
  for (const std::string& bad :
       std::vector<std::string>{"acme/", "/best", "acme/x", "acme/best/x", "a.b/best", "../best", "logs/best",
                                "epoch_0/best", "best/best", std::string(65, 'a') + "/best"})
    CHECK_FALSE(is_artifact_name(bad));
  for (const char* good : {"acme", "tenant-7", "a+b", "T_1"}) CHECK(is_adapter_name(good));
  for (const char* bad : {"a.b", "logs", "tensorboard", "profile", "best", "resume_state", "epoch_3", "-x", "a/b"})
    CHECK_FALSE(is_adapter_name(bad));
  CHECK(is_run_id("65f0c2aa00112233445566ff"));
  CHECK_FALSE(is_run_id("65f0c2aa00112233445566f"));
  CHECK_FALSE(is_run_id("65f0c2aa00112233445566fg"));
  CHECK(is_database_name("lorarun_runs-2"));
  CHECK_FALSE(is_database_name(std::string(64, 'a')));
}

TEST_CASE("a refused name is one printable line that says where it came from") {
  try {
    check_relative_file_name("../\x1b[31mx\n\xff"s, "run lorarun/65f0 lists a file named");
    FAIL("refused nothing");
  } catch (const Error& e) {
    const std::string m = e.what();
    CHECK_THAT(m, Catch::StartsWith("run lorarun/65f0 lists a file named '../\\x1b[31mx\\n\\xff'"));
    CHECK_THAT(m, Catch::Contains("refusing it"));
    CHECK(m.find('\n') == std::string::npos);
    CHECK(m.find('\x1b') == std::string::npos);
  }
  CHECK_THROWS_AS(check_artifact_name("../../x", "w"), Error);
  CHECK_THROWS_AS(check_run_id("x", "w"), Error);
  CHECK_NOTHROW(check_artifact_name("epoch_3", "w"));
}

TEST_CASE("printable and one_line escape what a terminal would act on, and keep the rest") {
  CHECK(printable("plain text, café") == "plain text, café");
  CHECK(printable("a\\b") == "a\\\\b");
  CHECK(one_line("a\\b") == "a\\b");
  CHECK(printable("\x1b[2J\r\n\t\x7f") == "\\x1b[2J\\r\\n\\t\\x7f");
  CHECK(printable("\xc3") == "\\xc3");                    // a cut sequence
  CHECK(printable("\xc0\xaf") == "\\xc0\\xaf");           // an overlong '/'
  CHECK(printable("\xed\xa0\x80") == "\\xed\\xa0\\x80");  // a surrogate
  CHECK(printable("\u202e") == "\\u{202e}");              // a bidi override
  CHECK(printable(std::string(500, 'x'), 10) == std::string(10, 'x') + "… (500 bytes)");
  CHECK(one_line(std::string(5000, 'y')) == std::string(5000, 'y'));
  // a document's text on a terminal: its lines kept, nothing it holds acts on the terminal
  CHECK(terminal_text("two\nlines\tand a tab") == "two\nlines\tand a tab");
  CHECK(terminal_text("\x1b[2Jclear\a\u202eevil\r") == "\\x1b[2Jclear\\x07\\u{202e}evil\\r");
}

TEST_CASE("files a run writes: never through a planted link, into a FIFO or into another file's hard link") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("lorarun-outfile-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "out");
  std::ofstream(dir / "victim") << "precious";
  const auto victim = [&] {
    std::ifstream in(dir / "victim");
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  fs::create_symlink(dir / "victim", dir / "out" / "metrics.jsonl");
  CHECK_THROWS_WITH(io::OutFile((dir / "out" / "metrics.jsonl").string(), io::OutFile::Mode::Append),
                    Catch::Contains("metrics.jsonl is a symbolic link"));
  fs::create_hard_link(dir / "victim", dir / "out" / "rank_0.log");
  CHECK_THROWS_WITH(io::OutFile((dir / "out" / "rank_0.log").string(), io::OutFile::Mode::Truncate),
                    Catch::Contains("it has 2 hard links"));
  REQUIRE(mkfifo((dir / "out" / "events").c_str(), 0600) == 0);
  CHECK_THROWS_WITH(io::OutFile((dir / "out" / "events").string(), io::OutFile::Mode::Append),
                    Catch::Contains("it is a FIFO"));
  // an atomic write's temporary name, planted as a link, is not written through
  fs::create_symlink(dir / "victim", dir / "out" / fmt::format("recipe.yaml.tmp.{}", getpid()));
  io::write_file_atomic((dir / "out" / "recipe.yaml").string(), "model: {}\n");
  CHECK(victim() == "precious");
  CHECK(io::read_file((dir / "out" / "recipe.yaml").string()) == "model: {}\n");
  // the directory as a whole: its first link named
  CHECK_THROWS_WITH(
      io::refuse_links((dir / "out").string(), "checkpoint.output_dir"),
      Catch::Contains("holds a symbolic link") && Catch::Contains("metrics.jsonl (to " + (dir / "victim").string()));
  fs::remove(dir / "out" / "metrics.jsonl");
  CHECK_NOTHROW(io::refuse_links((dir / "out").string(), "checkpoint.output_dir"));
  {
    io::OutFile f((dir / "out" / "metrics.jsonl").string(), io::OutFile::Mode::Append);
    f.write("{\"step\": 1}\n");
  }
  CHECK(io::read_file((dir / "out" / "metrics.jsonl").string()) == "{\"step\": 1}\n");
  fs::remove_all(dir);
}
