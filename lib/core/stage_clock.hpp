#pragma once
// Wall-clock split of one forward call into named stages, for mechanisms whose decision step
// (hashing, clustering, sorting) and attention run as separate phases: the timing harness opens a
// window around every timed call, and the mechanism calls lap("route") / lap("attend") from the
// calling thread (OpenMP thread 0, e.g. in `omp master` right after a loop's implicit barrier) when
// a phase has finished on every thread. A lap charges the time since the previous lap (or since the
// window opened) to its stage. Outside an open window lap() does nothing.
#include <cstddef>
#include <map>
#include <string>

namespace xfb::stage_clock {

void open();
// `stage` must be a string literal (its pointer is kept until close()); at most 8 per call.
void lap(const char* stage);
// While muted, lap() and restart() do nothing (a layer-scope training step times the whole layer's
// forward and backward, not the mechanism's own stages inside them).
void mute(bool muted);
// Stages charged so far in the open window (0 outside one).
std::size_t stages();
// Charges the time since the previous lap to no stage (e.g. a layer's work before its attention).
void restart();
// Closes the window; nanoseconds per stage of this call (empty if the mechanism has no stages).
std::map<std::string, double> close();

}  // namespace xfb::stage_clock
