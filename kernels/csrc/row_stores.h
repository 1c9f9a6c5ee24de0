// How an update out of place stores the rows it writes elsewhere (new fp32 values and moments,
// saved gradients): streamed (non-temporal) or through the cache, chosen by measurement.
//
// [Note: streamed or cached row stores] The rows an update out of place writes are not read
// again until the next step's update, so a non-temporal store skips reading each line before
// writing it: on 2026-11-29's AMD EPYC VM the speculative update took 3.1-3.8 ms streamed
// against 4.1-5.7 ms through the cache (3.15M elements, bf16 gradients, fp32 states, one core;
// in place 2.6-3.5 ms). On 2026-12-01's Ice Lake VM the same streamed stores made it
// 17.2 ms against 7.3 ms through the cache (in place 3.9 ms), and the overlapped step hid none
// of the clipped update. Most of that was how the lanes stored them, a part of a line at a time
// between the other rows' stores ([Note: whole lines a step] in host_optim_avx2.h): stored a
// whole line at a time, the same VM's streamed update took 7.3 ms against 8.1 through the cache
// (4.6 in place), and 35 against 58 at 17M elements. Which kind wins is still the machine's,
// and the bits are the same either way, so the library measures: large out-of-place calls alternate the two kinds, and once each
// has its trial calls the one with the lower median time per element is used from then on. A
// call writing rows for the first time is not timed: it faults their pages in (in an engine
// where 4 warm-up calls were all, the first step's fresh shadows timed the cached kind at 14.3
// ns an element against 5.0 streamed; timed on rows written before, 1.9 against 5.2).
// cmo_cpu_set_row_stores forces a kind (tests, ablations) or measures anew.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <unordered_set>
#include <vector>

namespace cmo {

enum RowStores : int { kMeasure = -1, kStreamed = 0, kCached = 1 };

class RowStoreChooser {
 public:
  // Calls below this many elements are not timed (too short to tell the kinds apart).
  static constexpr int64_t kTimedMinNumel = 1 << 18;
  // Rows written before are remembered up to this many (then every row counts as written).
  static constexpr size_t kMaxRemembered = 1 << 12;
  // Timed calls of each kind before the choice.
  static constexpr int kTrialCalls = 6;

  // The kind for a call of `numel` elements whose first row written elsewhere starts at `row`;
  // `timed`: report its time with `finish`.
  RowStores begin(int64_t numel, const void* row, bool* timed) {
    std::lock_guard<std::mutex> lock(mutex_);
    *timed = false;
    if (chosen_ != kMeasure) return chosen_;
    if (numel < kTimedMinNumel) return kStreamed;
    const bool first_write =
        written_.size() < kMaxRemembered && written_.insert(reinterpret_cast<uintptr_t>(row)).second;
    if (first_write) return kStreamed;
    *timed = true;
    const RowStores kind = next_cached_ ? kCached : kStreamed;
    next_cached_ = !next_cached_;
    return kind;
  }

  void finish(RowStores kind, int64_t numel, double seconds) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (chosen_ != kMeasure || forced_) return;
    (kind == kCached ? cached_ : streamed_).push_back(seconds * 1e9 / static_cast<double>(numel));
    if (static_cast<int>(cached_.size()) >= kTrialCalls &&
        static_cast<int>(streamed_.size()) >= kTrialCalls)
      chosen_ = median(cached_) < median(streamed_) ? kCached : kStreamed;
  }

  // kMeasure: measure anew; kStreamed or kCached: that kind for every call from now on.
  void set(RowStores kind) {
    std::lock_guard<std::mutex> lock(mutex_);
    chosen_ = kind;
    forced_ = kind != kMeasure;
    written_.clear();
    next_cached_ = true;
    streamed_.clear();
    cached_.clear();
  }

  // The kind chosen (kMeasure while measuring); the median ns per element of each kind's
  // timed calls (0 without any) and how many there were.
  RowStores report(double* streamed_ns, double* cached_ns, int* streamed_calls,
                   int* cached_calls) const {
    std::lock_guard<std::mutex> lock(mutex_);
    *streamed_ns = streamed_.empty() ? 0.0 : median(streamed_);
    *cached_ns = cached_.empty() ? 0.0 : median(cached_);
    *streamed_calls = static_cast<int>(streamed_.size());
    *cached_calls = static_cast<int>(cached_.size());
    return chosen_;
  }

 private:
  static double median(std::vector<double> values) {
    const size_t mid = values.size() / 2;
    std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid),
                     values.end());
    const double upper = values[mid];
    if (values.size() % 2 == 1) return upper;
    return (*std::max_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid)) +
            upper) /
           2.0;
  }

  mutable std::mutex mutex_;
  RowStores chosen_ = kMeasure;
  bool forced_ = false;
  std::unordered_set<uintptr_t> written_;  // rows written before (their pages are in)
  bool next_cached_ = true;
  std::vector<double> streamed_, cached_;
};

// Times one call when the chooser asks to (steady clock, the call's wall time).
class TimedCall {
 public:
  using Clock = std::chrono::steady_clock;
  TimedCall(RowStoreChooser& chooser, int64_t numel, const void* row)
      : chooser_(chooser), numel_(numel), kind_(chooser.begin(numel, row, &timed_)),
        start_(Clock::now()) {}
  RowStores kind() const { return kind_; }
  // After a call that completed: its time counts toward the choice.
  void completed() {
    if (timed_)
      chooser_.finish(kind_, numel_,
                      std::chrono::duration<double>(Clock::now() - start_).count());
  }

 private:
  RowStoreChooser& chooser_;
  int64_t numel_;
  bool timed_ = false;
  RowStores kind_;
  Clock::time_point start_;
};

}  // namespace cmo
