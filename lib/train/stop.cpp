#include "train/stop.hpp"

#include <unistd.h>
#include <csignal>
#include <cstring>

namespace lorarun::train {
namespace {

// The one piece of process-wide state a signal handler may touch.
std::atomic<bool> g_stop_requested{false};
bool g_say_stop = false;

// Only write(2) is safe here.
void request_stop(int sig) {
  const bool again = g_stop_requested.exchange(true);
  if (!g_say_stop) return;
  const char* first = sig == SIGINT ? "lora-train: SIGINT: stopping after this step or evaluation batch, with the "
                                      "resumable state saved\n"
                                    : "lora-train: SIGTERM: stopping after this step or evaluation batch, with the "
                                      "resumable state saved\n";
  const char* more = "lora-train: still stopping: saving the resumable state (SIGKILL ends it without saving)\n";
  const char* m = again ? more : first;
  (void)!write(STDERR_FILENO, m, std::strlen(m));
}

}  // namespace

void install_stop_handlers(bool say) {
  g_say_stop = say;
  struct sigaction sa{};
  sa.sa_handler = request_stop;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

bool stop_requested() { return g_stop_requested; }

const std::atomic<bool>* stop_flag() { return &g_stop_requested; }

}  // namespace lorarun::train
