// The allocation hook under MemoryTracker on CPU: torch's CPU allocator, wrapped.
//
// Every CPU storage torch creates goes through c10's CPU allocator. This file puts a
// thin allocator in front of it (c10::SetCPUAllocator), so each allocation and each
// free is seen in C++ at the cost of a hash-map update: no Python runs per op, which
// is what makes a tracked step of a small model cost about what an untracked one does.
//
// Invariant: for every tracker ("state"), `total` is the sum of the bytes of the live
// allocations it holds, each held once under one category; an allocation is held
// from the moment the wrapped allocator hands it out (while the state is active) until
// its deleter runs, on whatever thread that is.
//
// Plain C functions, called from Python through ctypes: no Python headers needed.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/GradMode.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torch::autograd {
int get_current_graph_task_id();  // exported by libtorch_cpu; -1 outside backward
}

namespace {

constexpr int kCats = 16;
constexpr int kActivation = 3;  // index of "activation" in trace.CATEGORIES
constexpr int kOther = 5;       // index of "other"

struct Entry {
  int64_t nbytes;
  int cat;
  uint64_t token;  // tells a registration's entry from a newer one at the same address
};

struct State {
  bool active = false;
  std::unordered_map<void*, Entry> live;
  int64_t by_cat[kCats] = {};
  int64_t peak[kCats] = {};
  int64_t total = 0, peak_total = 0, high_water = 0;

  // Returns 1 if the entry is new, 0 if it replaced a stale one (whose free we never saw).
  int add(void* p, int64_t n, int cat, uint64_t token) {
    auto it = live.find(p);
    int fresh = 1;
    if (it != live.end()) {
      drop(it);
      fresh = 0;
    }
    live.emplace(p, Entry{n, cat, token});
    by_cat[cat] += n;
    total += n;
    if (total > high_water) high_water = total;
    if (total > peak_total) {
      peak_total = total;
      std::copy(by_cat, by_cat + kCats, peak);
    }
    return fresh;
  }
  void drop(std::unordered_map<void*, Entry>::iterator it) {
    by_cat[it->second.cat] -= it->second.nbytes;
    total -= it->second.nbytes;
    live.erase(it);
  }
};

std::mutex g_mu;
std::unordered_map<int, State*> g_states;  // every tracker not yet destroyed
std::atomic<int> g_active{0};              // trackers currently seeing allocations
std::atomic<int64_t> g_held{0};            // entries held across trackers: frees skip the lock at 0
int g_next_id = 1;
uint64_t g_next_token = 1;
c10::Allocator* g_orig = nullptr;
c10::DeleterFnPtr g_orig_delete = nullptr;

// Labels from `MemoryTracker.category(...)`, per thread, per tracker: (tracker id, category).
thread_local std::vector<std::pair<int, int>> tl_labels;
// `memory.exclusive(tracker)` sections, per thread: the one tracker that sees (0: none).
thread_local std::vector<int> tl_only;

int label_for(int id, int& implicit) {
  for (auto it = tl_labels.rbegin(); it != tl_labels.rend(); ++it)
    if (it->first == id) return it->second;
  if (implicit < 0)  // the forward of a training step, or anything inside backward
    implicit = (c10::GradMode::is_enabled() || torch::autograd::get_current_graph_task_id() != -1)
        ? kActivation
        : kOther;
  return implicit;
}

void tracked_delete(void* p) {
  if (g_held.load(std::memory_order_relaxed) > 0) {
    std::lock_guard<std::mutex> lock(g_mu);
    for (auto& kv : g_states) {
      auto it = kv.second->live.find(p);
      if (it != kv.second->live.end()) {
        kv.second->drop(it);
        g_held--;
      }
    }
  }
  g_orig_delete(p);
}

struct TrackingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr d = g_orig->allocate(n);
    void* p = d.get();
    c10::Device dev = d.device();
    // Same pointer, same context, our deleter in front of the original one.
    d.release_context();
    if (p != nullptr && n > 0 && g_active.load(std::memory_order_relaxed) > 0) {
      int implicit = -1;
      std::lock_guard<std::mutex> lock(g_mu);
      const int only = tl_only.empty() ? -1 : tl_only.back();
      for (auto& kv : g_states) {
        if (!kv.second->active || (only >= 0 && kv.first != only)) continue;
        g_held += kv.second->add(p, static_cast<int64_t>(n), label_for(kv.first, implicit), 0);
      }
    }
    return {p, p, &tracked_delete, dev};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &tracked_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

TrackingAllocator g_tracking;

State* find(int id) {
  auto it = g_states.find(id);
  return it == g_states.end() ? nullptr : it->second;
}

}  // namespace

extern "C" {

// 1 when the wrapper is in place (now or before); 0 when the CPU allocator cannot be
// wrapped (its deleter is not a plain function of the pointer).
int pl_install() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_orig != nullptr) return 1;
  c10::Allocator* cur = c10::GetCPUAllocator();
  if (cur == nullptr || cur->raw_deleter() == nullptr) return 0;
  g_orig = cur;
  g_orig_delete = cur->raw_deleter();
  // A process forked while another thread held the lock would inherit it held: hold it
  // across fork() so both sides start with it free.
  pthread_atfork([] { g_mu.lock(); }, [] { g_mu.unlock(); }, [] { g_mu.unlock(); });
  c10::SetCPUAllocator(&g_tracking, /*priority=*/UINT8_MAX);
  return c10::GetCPUAllocator() == &g_tracking ? 1 : 0;
}

int pl_new_state() {
  std::lock_guard<std::mutex> lock(g_mu);
  int id = g_next_id++;
  g_states[id] = new State();
  return id;
}

void pl_free_state(int id) {
  std::lock_guard<std::mutex> lock(g_mu);
  State* s = find(id);
  if (s == nullptr) return;
  if (s->active) g_active--;
  g_held -= static_cast<int64_t>(s->live.size());
  g_states.erase(id);
  delete s;
}

void pl_set_active(int id, int on) {
  std::lock_guard<std::mutex> lock(g_mu);
  State* s = find(id);
  if (s == nullptr || s->active == (on != 0)) return;
  s->active = on != 0;
  g_active += on ? 1 : -1;
}

void pl_push_label(int id, int cat) { tl_labels.emplace_back(id, cat); }

void pl_pop_label(int id) {
  for (auto it = tl_labels.rbegin(); it != tl_labels.rend(); ++it)
    if (it->first == id) {
      tl_labels.erase(std::next(it).base());
      return;
    }
}

void pl_push_only(int id) { tl_only.push_back(id); }

void pl_pop_only() {
  if (!tl_only.empty()) tl_only.pop_back();
}

// Put the allocation at `p` under `cat`. Returns 0 if the tracker already held it
// (relabelled), else a token > 0 for the entry just added with `nbytes` (a storage
// that existed before the tracker, or was made while it was stopped): if that
// storage's deleter is not ours, only Python sees it die, and calls pl_forget.
uint64_t pl_relabel(int id, void* p, int64_t nbytes, int cat) {
  std::lock_guard<std::mutex> lock(g_mu);
  State* s = find(id);
  if (s == nullptr || p == nullptr) return 0;
  auto it = s->live.find(p);
  if (it != s->live.end()) {
    Entry& e = it->second;
    if (e.cat != cat) {
      s->by_cat[e.cat] -= e.nbytes;
      s->by_cat[cat] += e.nbytes;
      e.cat = cat;
    }
    return 0;
  }
  uint64_t token = g_next_token++;
  g_held += s->add(p, nbytes, cat, token);
  return token;
}

// Is `p` held, and under which category (-1 if not)?
int pl_category(int id, void* p) {
  std::lock_guard<std::mutex> lock(g_mu);
  State* s = find(id);
  if (s == nullptr) return -1;
  auto it = s->live.find(p);
  return it == s->live.end() ? -1 : it->second.cat;
}

void pl_forget(int id, void* p, uint64_t token) {
  std::lock_guard<std::mutex> lock(g_mu);
  State* s = find(id);
  if (s == nullptr) return;
  auto it = s->live.find(p);
  if (it != s->live.end() && it->second.token == token) {
    s->drop(it);
    g_held--;
  }
}

// by_cat[kCats], peak[kCats], totals[3] = (total, peak_total, high_water).
void pl_read(int id, int64_t* by_cat, int64_t* peak, int64_t* totals) {
  std::lock_guard<std::mutex> lock(g_mu);
  State* s = find(id);
  if (s == nullptr) return;
  std::copy(s->by_cat, s->by_cat + kCats, by_cat);
  std::copy(s->peak, s->peak + kCats, peak);
  totals[0] = s->total;
  totals[1] = s->peak_total;
  totals[2] = s->high_water;
}

void pl_reset_peak(int id) {
  std::lock_guard<std::mutex> lock(g_mu);
  State* s = find(id);
  if (s == nullptr) return;
  std::copy(s->by_cat, s->by_cat + kCats, s->peak);
  s->peak_total = s->total;
}

int64_t pl_take_high_water(int id) {
  std::lock_guard<std::mutex> lock(g_mu);
  State* s = find(id);
  if (s == nullptr) return 0;
  int64_t hw = std::max(s->high_water, s->total);
  s->high_water = s->total;
  return hw;
}

// The `n` largest held allocations: bytes and categories, largest first. Returns how many.
int pl_largest(int id, int n, int64_t* nbytes, int* cats) {
  std::lock_guard<std::mutex> lock(g_mu);
  State* s = find(id);
  if (s == nullptr) return 0;
  std::vector<std::pair<int64_t, int>> all;
  all.reserve(s->live.size());
  for (auto& kv : s->live) all.emplace_back(kv.second.nbytes, kv.second.cat);
  int k = std::min<int>(n, static_cast<int>(all.size()));
  std::partial_sort(all.begin(), all.begin() + k, all.end(),
                    [](auto& a, auto& b) { return a.first > b.first; });
  for (int i = 0; i < k; ++i) {
    nbytes[i] = all[i].first;
    cats[i] = all[i].second;
  }
  return k;
}

}  // extern "C"
