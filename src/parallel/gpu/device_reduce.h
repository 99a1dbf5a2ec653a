// The device communicator's reduce kernel (device_reduce.cu): out = the peers' sum, in rank order.
#pragma once
#include <cstdint>

namespace msa::parallel {

// The peers' addresses travel as a kernel argument (no upload): at most this many ranks.
constexpr int kMaxDeviceRanks = 64;
struct PeerPointers {
  const float* at[kMaxDeviceRanks];
};

// out[i] = ((peers[0][i] + peers[1][i]) + peers[2][i]) + ... (f32, no contraction: the host
// loop's order and rounding), on `stream` (a cudaStream_t).
void sum_peers_on_device(const PeerPointers& peers, int world, int64_t count, float* out, void* stream);

}  // namespace msa::parallel
