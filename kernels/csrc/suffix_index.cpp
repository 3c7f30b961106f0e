// The suffix drafter's n-gram index (drafters/suffix_index.py is its Python handle): where
// the context's suffix occurred before and how long each match is. Native because a
// lookup runs for every request on every step, and in Python its appends, walks and
// backward comparisons cost tens of microseconds a step; here a step is a few calls.
//
// Layout, as in LZ77 matchers: for each n in kLevels, a head table maps the hash of an
// n-gram to the newest position that followed it (+1, modulo 2**32; 0: none), and a link
// per position gives the distance back to the previous position that followed an n-gram of
// the same hash bucket (0: none). A lookup walks at most kMaxWalk links per level, newest
// first, and compares tokens backwards, which measures each match and rejects collisions.
//
// Positions are global and only grow. A ring (capacity > 0) keeps position p in slot
// p % capacity, every position below `floor` gone, and a head table of one bucket per
// position of capacity (a power of two). An unbounded index (a request's own context)
// doubles its head tables as it grows, re-indexing its tokens, so a bucket holds about one
// n-gram. Every entry point checks its arguments and returns a negative code on bad ones.
#include <algorithm>
#include <cstdint>
#include <new>
#include <vector>

namespace {

constexpr int kNumLevels = 3;
constexpr int kLevels[kNumLevels] = {2, 4, 8};  // n-gram lengths with a chain
constexpr int kMaxN = 8;
constexpr int kMaxWalk = 16;  // links visited per level and lookup
constexpr int kMaxFound = 2 * kMaxWalk;  // a lookup's evidence: own walk then cache walk
constexpr int32_t kSeparator = -1;
constexpr uint64_t kMask32 = 0xFFFFFFFFull;
constexpr int64_t kMinRingBuckets = 1 << 10;
constexpr int64_t kMinOwnBuckets = 1 << 8;

constexpr int64_t kBadArgument = -1;
constexpr int64_t kNoMemory = -2;
constexpr int64_t kTooSmall = -3;

// Read by Python through ctypes (SuffixIndex's _Header): keep first and in this order.
struct Header {
  int64_t end;          // positions written so far
  int64_t floor;        // the oldest position still readable
  int64_t capacity;     // ring slots; 0: unbounded
  int64_t num_buckets;  // per level's head table
};

struct Index {
  Header header;
  int bits = 0;  // log2(num_buckets)
  std::vector<int32_t> tokens;  // by slot
  std::vector<uint32_t> links[kNumLevels];  // by slot: distance back, 0: none
  std::vector<uint32_t> heads[kNumLevels];  // by bucket: newest follower + 1 mod 2**32, 0: none
  int32_t segment[kMaxN] = {};  // the current segment's last tokens, oldest first
  int segment_length = 0;
};

int64_t slot_of(const Index& index, int64_t position) {
  return index.header.capacity > 0 ? position % index.header.capacity : position;
}

uint64_t hash_ngram(const int32_t* ngram, int n) {  // ngram[0:n], oldest first
  uint64_t h = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(n + 1);
  for (int i = 0; i < n; ++i) {
    h = (h ^ static_cast<uint32_t>(ngram[i])) * 0xFF51AFD7ED558CCDull;
    h ^= h >> 29;
  }
  return h;
}

uint64_t bucket_of(const Index& index, const int32_t* ngram, int n) {
  return hash_ngram(ngram, n) >> (64 - index.bits);
}

// The newest position that followed the bucket's n-grams, or -1; heads are stored modulo
// 2**32 and recovered relative to `end`, unambiguous while end - position < 2**32.
int64_t head_at(const Index& index, int level, uint64_t bucket, int64_t end) {
  const uint32_t stored = index.heads[level][bucket];
  if (stored == 0) return -1;
  return end - static_cast<int64_t>((static_cast<uint64_t>(end) - stored) & kMask32) - 1;
}

void set_bucket_count(Index& index, int64_t num_buckets) {
  index.header.num_buckets = num_buckets;
  index.bits = 0;
  while ((int64_t{1} << index.bits) < num_buckets) ++index.bits;
  for (auto& heads : index.heads) heads.assign(num_buckets, 0);
}

// Index position `position` (in `slot`, holding `token`) as the newest follower of each
// level's n-gram ending just before it, then take the token into the segment.
void index_token(Index& index, int64_t position, int64_t slot, int32_t token) {
  for (int level = 0; level < kNumLevels; ++level) {
    const int n = kLevels[level];
    uint32_t link = 0;
    if (token != kSeparator && index.segment_length >= n) {
      const uint64_t bucket = bucket_of(index, index.segment + index.segment_length - n, n);
      const int64_t previous = head_at(index, level, bucket, position);
      index.heads[level][bucket] = static_cast<uint32_t>((position + 1) & kMask32);
      const int64_t distance = position - previous;
      if (previous >= 0 && previous >= index.header.floor && distance <= static_cast<int64_t>(kMask32)) {
        link = static_cast<uint32_t>(distance);
      }
    }
    index.links[level][slot] = link;
  }
  if (token == kSeparator) {
    index.segment_length = 0;
    return;
  }
  if (index.segment_length == kMaxN) {
    std::copy(index.segment + 1, index.segment + kMaxN, index.segment);
    --index.segment_length;
  }
  index.segment[index.segment_length++] = token;
}

// Make `slot` exist: the arrays grow (geometrically, never past a ring's capacity) until
// they hold every slot.
void reserve_slot(Index& index, int64_t slot) {
  const auto size = static_cast<int64_t>(index.tokens.size());
  if (slot < size) return;
  if (slot >= static_cast<int64_t>(index.tokens.capacity())) {
    int64_t room = std::max<int64_t>({slot + 1, 2 * size, 1024});
    if (index.header.capacity > 0) room = std::min(room, index.header.capacity);
    index.tokens.reserve(room);
    for (auto& links : index.links) links.reserve(room);
  }
  index.tokens.resize(slot + 1, kSeparator);
  for (auto& links : index.links) links.resize(slot + 1, 0);
}

// An unbounded index's head tables double (re-indexing every token) until they hold at
// least `positions` buckets: chains then rarely merge, so walks see mostly true occurrences.
void grow_heads(Index& index, int64_t positions) {
  int64_t num_buckets = index.header.num_buckets;
  while (num_buckets < positions) num_buckets *= 2;
  set_bucket_count(index, num_buckets);
  index.segment_length = 0;
  for (int64_t position = 0; position < index.header.end; ++position) {
    index_token(index, position, position, index.tokens[position]);
  }
}

void append(Index& index, int32_t token) {
  Header& header = index.header;
  const int64_t position = header.end;
  if (header.capacity > 0) header.floor = std::max(header.floor, position + 1 - header.capacity);
  const int64_t slot = slot_of(index, position);
  reserve_slot(index, slot);
  index.tokens[slot] = token;
  index_token(index, position, slot, token);
  header.end = position + 1;
  if (header.capacity == 0 && header.end > header.num_buckets) grow_heads(index, header.end);
}

// The occurrences on one level's chain from `position` whose match with the context is at
// least n long; tail[0:tail_length] is the context's last tokens, last first.
int walk(const Index& index, int level, int64_t position, const int32_t* tail, int64_t tail_length,
         int64_t* positions, int32_t* lengths) {
  const int n = kLevels[level];
  const int64_t floor = index.header.floor;
  const auto& links = index.links[level];
  int found = 0;
  for (int step = 0; step < kMaxWalk && position >= floor; ++step) {
    const int64_t limit = std::min(tail_length, position - floor);
    int64_t length = 0;
    while (length < limit && index.tokens[slot_of(index, position - 1 - length)] == tail[length]) ++length;
    if (length >= n) {  // shorter: a hash collision
      positions[found] = position;
      lengths[found] = static_cast<int32_t>(length);
      ++found;
    }
    const uint32_t distance = links[slot_of(index, position)];
    if (distance == 0) break;
    position -= distance;
  }
  return found;
}

// The occurrences of the context's suffix on the longest level that has a verified one,
// newest first (at most kMaxWalk); tail as in walk, its length already capped at max_match.
int find_matches(const Index& index, const int32_t* tail, int64_t tail_length, int64_t* positions,
                 int32_t* lengths) {
  if (index.header.end == index.header.floor) return 0;
  for (int level = kNumLevels - 1; level >= 0; --level) {
    const int n = kLevels[level];
    if (tail_length < n) continue;
    int32_t ngram[kMaxN];
    for (int i = 0; i < n; ++i) ngram[i] = tail[n - 1 - i];
    const int64_t head = head_at(index, level, bucket_of(index, ngram, n), index.header.end);
    const int found = walk(index, level, head, tail, tail_length, positions, lengths);
    if (found > 0) return found;
  }
  return 0;
}

// Up to `count` tokens from `position` on, stopping at a separator or the end.
int64_t read_continuation(const Index& index, int64_t position, int64_t count, int32_t* out) {
  if (position < index.header.floor || count <= 0) return 0;
  const int64_t stop = std::min(index.header.end, position + count);
  int64_t written = 0;
  for (int64_t p = position; p < stop; ++p) {
    const int32_t token = index.tokens[slot_of(index, p)];
    if (token == kSeparator) break;
    out[written++] = token;
  }
  return written;
}

int64_t bucket_count_for_ring(int64_t capacity) {
  int64_t buckets = kMinRingBuckets;
  while (buckets < capacity) buckets *= 2;
  return buckets;
}

}  // namespace

extern "C" {

// A new index; capacity 0: unbounded. `start`: its first position (end = floor = start).
void* specdec_suffix_create(int64_t capacity, int64_t start) {
  if (capacity < 0 || capacity > (int64_t{1} << 31) || start < 0) return nullptr;
  if (capacity == 0 && start != 0) return nullptr;
  Index* index = new (std::nothrow) Index();
  if (index == nullptr) return nullptr;
  try {
    index->header = {start, start, capacity, 0};
    set_bucket_count(*index, capacity > 0 ? bucket_count_for_ring(capacity) : kMinOwnBuckets);
  } catch (const std::bad_alloc&) {
    delete index;
    return nullptr;
  }
  return index;
}

void specdec_suffix_free(void* handle) { delete static_cast<Index*>(handle); }

// Append tokens[0:count] to the current segment. Returns 0, or a negative code.
int64_t specdec_suffix_extend(void* handle, const int32_t* tokens, int64_t count) {
  if (handle == nullptr || count < 0 || (count > 0 && tokens == nullptr)) return kBadArgument;
  auto& index = *static_cast<Index*>(handle);
  try {
    // A prompt's tokens: size the head tables once for all of them, not doubling on the way.
    const int64_t end = index.header.end + count;
    if (index.header.capacity == 0 && end > index.header.num_buckets) grow_heads(index, end);
    for (int64_t i = 0; i < count; ++i) append(index, tokens[i]);
  } catch (const std::bad_alloc&) {
    return kNoMemory;
  }
  return 0;
}

// Append one token (the common step: one committed token), range-checked to 32 bits.
int64_t specdec_suffix_push(void* handle, int64_t token) {
  if (handle == nullptr || token < INT32_MIN || token > INT32_MAX) return kBadArgument;
  const auto narrow = static_cast<int32_t>(token);
  return specdec_suffix_extend(handle, &narrow, 1);
}

// Later tokens never extend a match across this point (a separator is written if any
// position is readable).
int64_t specdec_suffix_start_segment(void* handle) {
  if (handle == nullptr) return kBadArgument;
  auto& index = *static_cast<Index*>(handle);
  if (index.header.end > index.header.floor) {
    const int64_t status = specdec_suffix_extend(handle, &kSeparator, 1);
    if (status != 0) return status;
  }
  index.segment_length = 0;
  return 0;
}

// Positions below `position` are evicted and their tokens wiped.
int64_t specdec_suffix_forget_before(void* handle, int64_t position) {
  if (handle == nullptr) return kBadArgument;
  auto& index = *static_cast<Index*>(handle);
  position = std::min(position, index.header.end);
  for (int64_t p = index.header.floor; p < position; ++p) index.tokens[slot_of(index, p)] = kSeparator;
  index.header.floor = std::max(index.header.floor, position);
  return 0;
}

// The occurrences of the context's suffix: context[0:length] its last tokens (oldest
// first), max_match the longest match measured. Writes at most kMaxWalk (position, match
// length) pairs, newest first; returns how many, or a negative code.
int64_t specdec_suffix_matches(const void* handle, const int32_t* context, int64_t length, int64_t max_match,
                               int64_t* positions, int32_t* lengths, int64_t room) {
  if (handle == nullptr || length < 0 || (length > 0 && context == nullptr) || max_match < 0 ||
      positions == nullptr || lengths == nullptr) {
    return kBadArgument;
  }
  if (room < kMaxWalk) return kTooSmall;
  std::vector<int32_t> tail;
  try {
    tail.resize(std::min(length, max_match));
  } catch (const std::bad_alloc&) {
    return kNoMemory;
  }
  for (int64_t i = 0; i < static_cast<int64_t>(tail.size()); ++i) tail[i] = context[length - 1 - i];
  return find_matches(*static_cast<const Index*>(handle), tail.data(), static_cast<int64_t>(tail.size()),
                      positions, lengths);
}

// One drafting step's lookup, the context being the `own` index's readable tokens: the
// occurrences of its longest matched suffix in `own`, then in `cache` (may be null), newest
// first in each, only those whose match is the longest found; and, if max_depth > 0, each
// one's continuation min(max_depth, max(1, int(spec_factor * match))) tokens deep at most.
// Writes items[0] = the match length, items[1] = that depth (0: no continuations), then per
// occurrence i < count: items[2 + i] its store (0: own, 1: cache), items[2 + kMaxFound + i]
// its position, items[2 + 2 * kMaxFound + i] its continuation's length, the continuation in
// tokens[i * depth :]. Returns the count, or a negative code (kTooSmall: items under
// 2 + 3 * kMaxFound, or tokens under kMaxFound * depth).
int64_t specdec_suffix_lookup(const void* own_handle, const void* cache_handle, int64_t max_match, int64_t max_depth,
                              double spec_factor, int64_t* items, int64_t items_room, int32_t* tokens,
                              int64_t tokens_room) {
  if (own_handle == nullptr || max_match < 0 || max_depth < 0 || !(spec_factor > 0) || items == nullptr ||
      (max_depth > 0 && tokens == nullptr)) {
    return kBadArgument;
  }
  if (items_room < 2 + 3 * kMaxFound) return kTooSmall;
  const auto& own = *static_cast<const Index*>(own_handle);
  int32_t tail[64];
  std::vector<int32_t> long_tail;
  const int64_t tail_length = std::min(max_match, own.header.end - own.header.floor);
  int32_t* tail_data = tail;
  if (tail_length > 64) {
    try {
      long_tail.resize(tail_length);
    } catch (const std::bad_alloc&) {
      return kNoMemory;
    }
    tail_data = long_tail.data();
  }
  for (int64_t i = 0; i < tail_length; ++i) tail_data[i] = own.tokens[slot_of(own, own.header.end - 1 - i)];

  int64_t positions[kMaxFound];
  int32_t lengths[kMaxFound];
  const Index* stores[kMaxFound];
  const int own_found = find_matches(own, tail_data, tail_length, positions, lengths);
  for (int i = 0; i < own_found; ++i) stores[i] = &own;
  int found = own_found;
  if (cache_handle != nullptr) {
    const auto* cache = static_cast<const Index*>(cache_handle);
    const int cache_found = find_matches(*cache, tail_data, tail_length, positions + found, lengths + found);
    for (int i = found; i < found + cache_found; ++i) stores[i] = cache;
    found += cache_found;
  }
  int32_t longest = 0;
  for (int i = 0; i < found; ++i) longest = std::max(longest, lengths[i]);
  items[0] = longest;
  const int64_t depth = found == 0 || max_depth == 0 ? 0
      : std::min<int64_t>(max_depth, std::max<int64_t>(1, static_cast<int64_t>(spec_factor * longest)));
  items[1] = depth;
  int count = 0;
  for (int i = 0; i < found; ++i) {
    if (lengths[i] != longest) continue;
    if ((count + 1) * depth > tokens_room) return kTooSmall;
    items[2 + count] = stores[i] == &own ? 0 : 1;
    items[2 + kMaxFound + count] = positions[i];
    items[2 + 2 * kMaxFound + count] = depth > 0 ? read_continuation(*stores[i], positions[i], depth,
                                                                     tokens + count * depth) : 0;
    ++count;
  }
  return count;
}

// A drafting step in one call (a call from Python costs more than the work on a step that
// finds nothing): append new_tokens[0:new_count] to `own`, then `specdec_suffix_lookup`.
int64_t specdec_suffix_step(void* own_handle, const void* cache_handle, const int32_t* new_tokens,
                            int64_t new_count, int64_t max_match, int64_t max_depth, double spec_factor,
                            int64_t* items, int64_t items_room, int32_t* tokens, int64_t tokens_room) {
  const int64_t status = specdec_suffix_extend(own_handle, new_tokens, new_count);
  if (status < 0) return status;
  return specdec_suffix_lookup(own_handle, cache_handle, max_match, max_depth, spec_factor, items, items_room,
                               tokens, tokens_room);
}

// Up to `count` tokens from `position` on into out[0:room], stopping at a separator or the
// end; returns how many.
int64_t specdec_suffix_continuation(const void* handle, int64_t position, int64_t count, int32_t* out,
                                    int64_t room) {
  if (handle == nullptr || count < 0 || (count > 0 && out == nullptr)) return kBadArgument;
  if (room < count) return kTooSmall;
  return read_continuation(*static_cast<const Index*>(handle), position, count, out);
}

// The readable tokens in [start, stop), separators included, into out[0:room]; returns how many.
int64_t specdec_suffix_read(const void* handle, int64_t start, int64_t stop, int32_t* out, int64_t room) {
  if (handle == nullptr) return kBadArgument;
  const auto& index = *static_cast<const Index*>(handle);
  start = std::max(start, index.header.floor);
  stop = std::min(stop, index.header.end);
  if (stop <= start) return 0;
  if (out == nullptr || room < stop - start) return kTooSmall;
  for (int64_t p = start; p < stop; ++p) out[p - start] = index.tokens[slot_of(index, p)];
  return stop - start;
}

// Every slot's token as stored (evicted ones wiped to the separator or overwritten), into
// out[0:room]; returns how many slots there are (only that if out is null).
int64_t specdec_suffix_slots(const void* handle, int32_t* out, int64_t room) {
  if (handle == nullptr) return kBadArgument;
  const auto& index = *static_cast<const Index*>(handle);
  const auto size = static_cast<int64_t>(index.tokens.size());
  if (out == nullptr) return size;
  if (room < size) return kTooSmall;
  std::copy(index.tokens.begin(), index.tokens.end(), out);
  return size;
}

// Bytes held by the arrays (allocated, not only used).
int64_t specdec_suffix_nbytes(const void* handle) {
  if (handle == nullptr) return kBadArgument;
  const auto& index = *static_cast<const Index*>(handle);
  int64_t total = static_cast<int64_t>(index.tokens.capacity() * sizeof(int32_t));
  for (const auto& links : index.links) total += static_cast<int64_t>(links.capacity() * sizeof(uint32_t));
  for (const auto& heads : index.heads) total += static_cast<int64_t>(heads.capacity() * sizeof(uint32_t));
  return total;
}

// The constants the Python handle must agree with, into out[0:room]: the levels, the walk
// limit, the separator, the lookup's evidence bound and the header's size. Returns how many.
int64_t specdec_suffix_layout(int64_t* out, int64_t room) {
  const int64_t values[] = {kLevels[0], kLevels[1], kLevels[2], kMaxWalk, kSeparator, kMaxFound,
                            static_cast<int64_t>(sizeof(Header))};
  constexpr int64_t count = sizeof(values) / sizeof(values[0]);
  if (out == nullptr || room < count) return kTooSmall;
  std::copy(values, values + count, out);
  return count;
}

}  // extern "C"
