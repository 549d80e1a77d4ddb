// SIGTERM and SIGINT (preemption, Ctrl-C, the launcher tearing down, Slurm's time-limit warning):
// a request to stop that the trainer honours between two units of work — a step, an evaluation
// batch — with the resumable state saved (kExitStopped).
#pragma once
#include <atomic>

namespace lorarun::train {

// From now on SIGTERM and SIGINT set the stop request. `say`: this process (rank 0) says so on
// stderr at once, and again at each further signal.
void install_stop_handlers(bool say);

// Whether a stop was requested.
bool stop_requested();

// The request as a flag for readers that wait (a retry's backoff gives up when it is set).
const std::atomic<bool>* stop_flag();

}  // namespace lorarun::train
